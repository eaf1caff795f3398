// The benchmarks' own tools: bench/onednn_verbose.h, which bench_train_gpt --gemms sums both sides' GEMM time
// with.
#include <gtest/gtest.h>

#include <string>

#include "bench/onednn_verbose.h"
#include "tensor/error.h"

namespace mixtape {
namespace {

using bench::parse_onednn_verbose;

// Lines as oneDNN 2.6 (mixtape) and the oneDNN in PyTorch 1.13 print them, with the log's other lines and a
// program's own output between them.
const char* const kLog =
    "onednn_verbose,info,oneDNN v2.6.0 (commit N/A)\n"
    "onednn_verbose,info,cpu,runtime:OpenMP\n"
    "onednn_verbose,info,prim_template:operation,engine,primitive,implementation,prop_kind,memory_descriptors,"
    "attributes,auxiliary,problem_desc,exec_time\n"
    "round 1/1 done\n"
    "onednn_verbose,exec,cpu,matmul,brg:avx512_core_bf16,undef,src_bf16::blocked:ab:f0 wei_bf16::blocked:ba:f0 "
    "bia_bf16::blocked:ab:f0_mask2 dst_bf16::blocked:ab:f0,,,2048x256:256x768:2048x768,0.886\n"
    "onednn_verbose,exec,cpu,matmul,brg:avx512_core_bf16,undef,src_bf16::blocked:ab:f0 wei_bf16::blocked:ab:f0 "
    "dst_bf16::blocked:ab:f0,attr-scratchpad:user attr-post-ops:sum ,,256x2048:2048x1024:256x1024,1.25\r\n"
    "onednn_verbose,exec,cpu,matmul,brg:avx512_core_bf16,undef,src_bf16::blocked:abc:f0 wei_bf16::blocked:abc:f0 "
    "dst_bf16::blocked:abc:f0,attr-scratchpad:user ,,64x128x64:64x64x128:64x128x128,0.5\n"
    "onednn_verbose,exec,cpu,eltwise,jit:avx512_core,forward_training,data_bf16::blocked:ab:f0 "
    "diff_undef::undef:::,,alg:eltwise_gelu_erf alpha:0 beta:0,2048x1024,0.25\n"
    "onednn_verbose,exec,cpu,eltwise,jit:avx512_core,backward_data,data_bf16::blocked:ab:f0,,alg:eltwise_gelu_erf "
    "alpha:0 beta:0,2048x1024,0.5\n"
    "mixtape bf16                   58.6       57.4        34977        35661\n";

TEST(OnednnVerbose, SumsTheExecutionsOfEachKind) {
  const bench::OnednnTimes t = parse_onednn_verbose(kLog);
  EXPECT_EQ(t.matmul.calls, 2);
  EXPECT_DOUBLE_EQ(t.matmul.ms, 0.886 + 1.25);
  EXPECT_EQ(t.batched.calls, 1);
  EXPECT_DOUBLE_EQ(t.batched.ms, 0.5);
  ASSERT_EQ(t.other.size(), 1u);
  ASSERT_TRUE(t.other.count("eltwise"));
  EXPECT_EQ(t.other.at("eltwise").calls, 2);
  EXPECT_DOUBLE_EQ(t.other.at("eltwise").ms, 0.75);
}

TEST(OnednnVerbose, ReadsLaterFormatsAndTheOldPrefix) {
  // oneDNN 3.x puts "primitive" (and optionally a timestamp) before "exec", and prints a matmul's problem as
  // src:wei; builds before the rename print dnnl_verbose.
  const bench::OnednnTimes t = parse_onednn_verbose(
      "onednn_verbose,v1,primitive,exec,cpu,matmul,brg:avx512_core_amx,undef,src_bf16::blocked:ab::f0 "
      "wei_bf16::blocked:ba::f0 dst_bf16::blocked:ab::f0,,,2048x256:256x768,0.4\n"
      "onednn_verbose,1700000000000.5,primitive,exec,cpu,matmul,brg:avx512_core_amx,undef,src:ab,,,"
      "4x2048x256:4x256x768,0.125\n"
      "dnnl_verbose,exec,cpu,reorder,jit:uni,undef,src_f32::blocked:ab:f0 dst_bf16::blocked:ab:f0,,,256x768,0.0625\n"
      "onednn_verbose,primitive,create:cache_miss,cpu,matmul,brg:avx512_core_amx,undef,src:ab,,,2048x256:256x768,3\n");
  EXPECT_EQ(t.matmul.calls, 1);
  EXPECT_DOUBLE_EQ(t.matmul.ms, 0.4);
  EXPECT_EQ(t.batched.calls, 1);
  EXPECT_DOUBLE_EQ(t.batched.ms, 0.125);
  ASSERT_TRUE(t.other.count("reorder"));
  EXPECT_EQ(t.other.at("reorder").calls, 1);
  EXPECT_DOUBLE_EQ(t.other.at("reorder").ms, 0.0625);
}

TEST(OnednnVerbose, AnExecLineItCannotReadIsAnErrorNamingIt) {
  const std::string prefix = "onednn_verbose,exec,cpu,matmul,brg:avx512_core_bf16,undef,src_bf16::blocked:ab:f0,,,";
  for (const std::string& line :
       {prefix + "2048x256:256x768:2048x768,", prefix + "2048x256:256x768:2048x768,fast",
        prefix + "2048x256:256x768:2048x768,-1", prefix + "2048x256,0.5", std::string("onednn_verbose,exec,cpu")}) {
    try {
      parse_onednn_verbose("onednn_verbose,info,cpu,runtime:OpenMP\n" + line + "\n");
      ADD_FAILURE() << "no error for " << line;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("oneDNN verbose log"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(line), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace mixtape
