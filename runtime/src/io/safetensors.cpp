// placeholder: the io area of the memrt runtime
namespace memrt {}
