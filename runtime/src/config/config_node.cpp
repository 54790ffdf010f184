// placeholder: the config area of the memrt runtime
namespace memrt {}
