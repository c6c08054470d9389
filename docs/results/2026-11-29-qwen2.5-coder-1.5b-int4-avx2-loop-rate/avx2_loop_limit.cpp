// The AVX2 int4 kernel's inner loop at this core's limit: how many of its instructions a cycle.
//
// Build and run: g++ -O2 avx2_loop_limit.cpp -o avx2_loop_limit && ./avx2_loop_limit
// Each loop repeats a block of independent instructions (no dependency chain longer than the
// block) 50 million times; the clock comes from a chain of dependent integer adds (one a cycle).
// The kernel's int4 path (`block_avx2` in leapdecode/models/quant.cpp) spends, per group of 32
// weights, 8 outputs and one row: 8 x (a broadcast load of 4 activations, `vpmaddubsw`, `vpaddw`),
// then a `vpmaddwd`, a convert, a multiply and two FMAs for the scales; the weights' unpacking
// (4 loads, 8 ands, 4 shifts) is shared by the 4 rows of a row block.
#include <chrono>
#include <cstdint>
#include <cstdio>

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

#define CLOBBER "memory", "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15"
#define X4(s) s s s s
#define X16(s) X4(X4(s))

static const long kRounds = 50000000;
alignas(64) static int activations[64] = {1};

template <typename F>
static double per_cycle(F body, int count, double ghz) {
  double start = now();
  for (long i = 0; i < kRounds; ++i) body();
  return count * kRounds / (now() - start) / 1e9 / ghz;
}

int main() {
  uint64_t x = 1;
  double start = now();
  for (long i = 0; i < 4 * kRounds; ++i) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  const double ghz = 4.0 * 4 * kRounds / (now() - start) / 1e9;
  const int* p = activations;
  printf("clock: %.2f GHz (dependent adds)\n", ghz);
  printf("vpaddw alone:                        %.2f a cycle\n", per_cycle([&] {
    asm volatile(X4("vpaddw %%ymm15,%%ymm14,%%ymm0\n vpaddw %%ymm15,%%ymm14,%%ymm1\n vpaddw %%ymm15,%%ymm14,%%ymm2\n vpaddw %%ymm15,%%ymm14,%%ymm3\n"
                    "vpaddw %%ymm15,%%ymm14,%%ymm4\n vpaddw %%ymm15,%%ymm14,%%ymm5\n vpaddw %%ymm15,%%ymm14,%%ymm6\n vpaddw %%ymm15,%%ymm14,%%ymm7\n") ::: CLOBBER);
  }, 32, ghz));
  printf("vpmaddubsw alone:                    %.2f a cycle\n", per_cycle([&] {
    asm volatile(X4("vpmaddubsw %%ymm15,%%ymm14,%%ymm0\n vpmaddubsw %%ymm15,%%ymm14,%%ymm1\n vpmaddubsw %%ymm15,%%ymm14,%%ymm2\n vpmaddubsw %%ymm15,%%ymm14,%%ymm3\n"
                    "vpmaddubsw %%ymm15,%%ymm14,%%ymm4\n vpmaddubsw %%ymm15,%%ymm14,%%ymm5\n vpmaddubsw %%ymm15,%%ymm14,%%ymm6\n vpmaddubsw %%ymm15,%%ymm14,%%ymm7\n") ::: CLOBBER);
  }, 32, ghz));
  printf("vpmaddubsw + vpaddw pairs:           %.2f a cycle\n", per_cycle([&] {
    asm volatile(X4("vpmaddubsw %%ymm15,%%ymm14,%%ymm8\n vpaddw %%ymm8,%%ymm0,%%ymm0\n vpmaddubsw %%ymm15,%%ymm13,%%ymm9\n vpaddw %%ymm9,%%ymm1,%%ymm1\n"
                    "vpmaddubsw %%ymm15,%%ymm12,%%ymm10\n vpaddw %%ymm10,%%ymm2,%%ymm2\n vpmaddubsw %%ymm15,%%ymm14,%%ymm11\n vpaddw %%ymm11,%%ymm3,%%ymm3\n") ::: CLOBBER);
  }, 16, ghz));
  printf("broadcast + vpmaddubsw + vpaddw:     %.2f a cycle\n", per_cycle([&] {
    asm volatile(X4("vpbroadcastd (%0),%%ymm12\n vpmaddubsw %%ymm12,%%ymm15,%%ymm8\n vpaddw %%ymm8,%%ymm0,%%ymm0\n"
                    "vpbroadcastd 4(%0),%%ymm13\n vpmaddubsw %%ymm13,%%ymm15,%%ymm9\n vpaddw %%ymm9,%%ymm1,%%ymm1\n"
                    "vpbroadcastd 8(%0),%%ymm12\n vpmaddubsw %%ymm12,%%ymm15,%%ymm10\n vpaddw %%ymm10,%%ymm2,%%ymm2\n"
                    "vpbroadcastd 12(%0),%%ymm13\n vpmaddubsw %%ymm13,%%ymm15,%%ymm11\n vpaddw %%ymm11,%%ymm3,%%ymm3\n") :: "r"(p) : CLOBBER);
  }, 16, ghz));
  printf("vpshufd + vpmaddubsw + vpaddw:      %.2f a cycle\n", per_cycle([&] {
    asm volatile(X4("vpshufd $0x00,%%ymm14,%%ymm12\n vpmaddubsw %%ymm12,%%ymm15,%%ymm8\n vpaddw %%ymm8,%%ymm0,%%ymm0\n"
                    "vpshufd $0x55,%%ymm14,%%ymm13\n vpmaddubsw %%ymm13,%%ymm15,%%ymm9\n vpaddw %%ymm9,%%ymm1,%%ymm1\n"
                    "vpshufd $0xaa,%%ymm14,%%ymm12\n vpmaddubsw %%ymm12,%%ymm15,%%ymm10\n vpaddw %%ymm10,%%ymm2,%%ymm2\n"
                    "vpshufd $0xff,%%ymm14,%%ymm13\n vpmaddubsw %%ymm13,%%ymm15,%%ymm11\n vpaddw %%ymm11,%%ymm3,%%ymm3\n") ::: CLOBBER);
  }, 16, ghz));
  printf("(%lu)\n", static_cast<unsigned long>(x & 1));
  return 0;
}
