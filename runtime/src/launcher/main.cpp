// launcher: placeholder until the engine lands.
#include <iostream>
int main() { std::cout << "memrt launcher\n"; return 0; }
