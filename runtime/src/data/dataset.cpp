// placeholder: the data area of the memrt runtime
namespace memrt {}
