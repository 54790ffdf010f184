// placeholder: the optim area of the memrt runtime
namespace memrt {}
