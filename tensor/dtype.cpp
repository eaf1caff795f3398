#include "tensor/dtype.h"

#include <ostream>

namespace mixtape {

int dtype_bits(DType dtype) {
  switch (dtype) {
    case DType::F32: case DType::I32: return 32;
    case DType::F16: case DType::BF16: return 16;
    case DType::F64: case DType::I64: return 64;
    case DType::F8E4M3: case DType::F8E5M2: case DType::F8E8M0: return 8;
    case DType::F4E2M1: return 4;
  }
  fail("dtype_bits: invalid dtype value ", static_cast<int>(dtype));
}

size_t dtype_size(DType dtype) {
  if (static_cast<int>(dtype) > static_cast<int>(DType::F4E2M1))
    fail("dtype_size: invalid dtype value ", static_cast<int>(dtype));
  const int bits = dtype_bits(dtype);
  if (bits < 8)
    fail("dtype_size: ", dtype_name(dtype), " packs two elements per byte, so an element has no byte size "
         "(use storage_bytes)");
  return static_cast<size_t>(bits / 8);
}

int64_t storage_bytes(DType dtype, int64_t numel) {
  const int bits = dtype_bits(dtype);
  if (bits < 8) return (numel + 1) / 2;
  int64_t bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<int64_t>(bits / 8), &bytes))
    fail("storage_bytes: ", numel, " elements of ", dtype_name(dtype), " need more bytes than fit in 64 bits");
  return bytes;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::F64: return "f64";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::F8E4M3: return "f8e4m3";
    case DType::F8E5M2: return "f8e5m2";
    case DType::F8E8M0: return "f8e8m0";
    case DType::F4E2M1: return "f4e2m1";
  }
  return "invalid";
}

DType promote(DType a, DType b) {
  if (a == b) return a;
  check(is_floating(a) && is_floating(b), "promote: cannot combine ", dtype_name(a), " with ", dtype_name(b),
        " (only floating dtypes promote; convert with an explicit to())");
  if (a == DType::F64 || b == DType::F64) return DType::F64;
  return DType::F32;  // f32 with anything narrower, or f16 with bf16
}

std::ostream& operator<<(std::ostream& out, DType dtype) { return out << dtype_name(dtype); }
std::ostream& operator<<(std::ostream& out, Half value) { return out << static_cast<float>(value); }
std::ostream& operator<<(std::ostream& out, BFloat16 value) { return out << static_cast<float>(value); }

}  // namespace mixtape
