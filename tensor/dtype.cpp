#include "tensor/dtype.h"

#include <ostream>

namespace mixtape {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::F64: case DType::I64: return 8;
  }
  fail("dtype_size: invalid dtype value ", static_cast<int>(dtype));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::F64: return "f64";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
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
