// placeholder: the dist area of the memrt runtime
namespace memrt {}
