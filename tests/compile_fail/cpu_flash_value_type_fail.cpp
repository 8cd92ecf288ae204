// SPDX-License-Identifier: Apache-2.0
// CpuFlash over an integer value type.
// expect: CpuFlash<T>: T must be float, double or bf16
#include <seqpar/attention/cpu_flash.hpp>

int main() {
  seqpar::attention::CpuFlash<int> kernel;
  (void)kernel;
}
