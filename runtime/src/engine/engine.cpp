// placeholder: the engine area of the memrt runtime
namespace memrt {}
