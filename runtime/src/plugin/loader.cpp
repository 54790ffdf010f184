// placeholder: the plugin area of the memrt runtime
namespace memrt {}
