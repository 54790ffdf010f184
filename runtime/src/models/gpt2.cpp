// placeholder: the models area of the memrt runtime
namespace memrt {}
