#include <chrono>
#include <cstdio>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
#define X4(s) s s s s
int main() {
  const long rounds = 400000000;  // ~5 s
  double start = now();
  for (long i = 0; i < rounds; ++i)
    asm volatile(X4("vpmaddubsw %%ymm15,%%ymm14,%%ymm8\n vpaddw %%ymm8,%%ymm0,%%ymm0\n vpmaddubsw %%ymm15,%%ymm13,%%ymm9\n vpaddw %%ymm9,%%ymm1,%%ymm1\n") ::: "ymm0","ymm1","ymm8","ymm9");
  printf("%.2f maddubs+paddw pairs a ns\n", 8.0 * rounds / (now() - start) / 1e9);
}
