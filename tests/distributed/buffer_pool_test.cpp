// BufferPool: one buffer per (purpose, dtype, size), handed out again on every later request.
#include "distributed/buffer_pool.hpp"

#include <gtest/gtest.h>

using namespace loom;
using namespace loom::dist;

TEST(BufferPool, OneBufferPerPurposeDtypeAndSize) {
  BufferPool pool;
  const Tensor a = pool.get(BufferPurpose::row_out, DType::f32, 16);
  EXPECT_EQ(a.numel(), 16);
  EXPECT_EQ(a.dtype(), DType::f32);
  // The same key: the same memory, nothing new allocated.
  EXPECT_EQ(pool.get(BufferPurpose::row_out, DType::f32, 16).data<float>(), a.data<float>());
  EXPECT_EQ(pool.count(), 1u);
  // Another purpose, dtype or size: a buffer of its own.
  const Tensor b = pool.get(BufferPurpose::col_dx, DType::f32, 16);
  const Tensor c = pool.get(BufferPurpose::row_out, DType::bf16, 16);
  const Tensor d = pool.get(BufferPurpose::row_out, DType::f32, 8);
  EXPECT_NE(b.data<float>(), a.data<float>());
  EXPECT_NE(d.data<float>(), a.data<float>());
  EXPECT_EQ(c.dtype(), DType::bf16);
  EXPECT_EQ(pool.count(), 4u);
  EXPECT_EQ(pool.bytes(), size_t(16 * 4 + 16 * 4 + 16 * 2 + 8 * 4));
}
