#pragma once
// Optimizer: what SGD, Adam and AdamW share — parameter groups, per-parameter state created on a
// parameter's first update, step() / zero_grad(), and a state_dict that makes a resumed run bit-exact.
//
// Parameters are leaf tensors updated in place (under NoGradGuard, bumping their version so a graph that
// saved them notices). A parameter whose .grad() is undefined is skipped: no update, no state, no step.
//
// Dtypes: the optimizer state (momentum buffers, exp_avg, exp_avg_sq) is kept in the dtype the update
// computes in — f64 for f64 parameters, f32 for f32, f16 and bf16 parameters. A 16-bit parameter is read
// into f32, updated in f32 with its f32 state, and rounded once (nearest even) on store. That keeps the
// moments accurate, but the parameter itself still loses every update smaller than half its ulp (bf16 has
// 8 significant bits): for real 16-bit training use amp/'s mixed-precision optimizer (f32 master weights).
//
// Devices: updates are the backend's fused multi-tensor kernels (Backend::adam_step / sgd_step), one call
// per device for all the parameters there, so CPU and CUDA parameters update alike.
//
// state_dict layout (io/state_dict.h; parameters are numbered 0, 1, ... in group order, as PyTorch does):
//   metadata "type"                       the optimizer's name(): "SGD", "Adam", "AdamW"
//            "param_groups"               the number of groups
//            "param_groups.<g>.params"    the number of parameters in group g
//            "param_groups.<g>.lr"        "param_groups.<g>.weight_decay"
//            <option>                     the optimizer's options ("momentum", "beta1", ...)
//            "state.<i>.step"             how many updates parameter i has had (only if it has state)
//   tensors  "state.<i>.<buffer>"         e.g. "state.3.exp_avg"; a snapshot, not an alias
// Numbers are the shortest decimal text that reads back to the same double (std::to_chars), so a load
// restores every hyperparameter bit for bit. load_state_dict restores lr, weight_decay and the options
// (as PyTorch does) and the state; it validates the whole dict first and changes nothing when it throws.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/state_dict.h"
#include "tensor/tensor.h"

namespace mixtape {

// A set of parameters sharing a learning rate and a weight decay (nanoGPT: one group of matrices and
// embeddings with decay, one of biases and norm weights without). The other hyperparameters (momentum,
// betas, eps) are the optimizer's and apply to every group.
struct ParamGroup {
  std::vector<Tensor> params;
  double lr = 0;
  double weight_decay = 0;
};

// What an optimizer keeps for one parameter.
struct ParamState {
  int64_t step = 0;  // updates applied to this parameter, counting the one in progress during update()
  std::map<std::string, Tensor> buffers;  // contiguous, on the parameter's device, in state_dtype(param)
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  const char* name() const { return name_; }  // "SGD", "Adam", "AdamW": error messages and the "type" entry

  // Updates every parameter that has a gradient. All parameters and gradients are checked before the
  // first one is changed, so a bad gradient leaves every parameter as it was.
  void step();
  // Drops every gradient (PyTorch's zero_grad(set_to_none=True)): the next backward starts from nothing.
  void zero_grad();

  // Mutable so a learning-rate schedule can set lr per group; checked again by step().
  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  void add_param_group(ParamGroup group);
  std::vector<Tensor> params() const;  // every parameter in group order: index i is "state.<i>" in state_dict

  const ParamState* state(const Tensor& param) const;  // null until param's first update
  // The dtype the state of `param` is kept (and its update computed) in: f64 for f64, else f32.
  static DType state_dtype(const Tensor& param);

  StateDict state_dict() const;
  void load_state_dict(const StateDict& dict);

 protected:
  // `name` is a string literal (the constructor cannot ask a virtual function: the derived part is not
  // built yet).
  Optimizer(const char* name, std::vector<ParamGroup> groups);

  // The names of the per-parameter state tensors (fixed per optimizer type) and whether they are kept now
  // (SGD without momentum keeps none, so its parameters get no state at all).
  virtual std::vector<std::string> buffer_names() const = 0;
  virtual bool keeps_state() const { return true; }
  // Whether a buffer holds a running mean of squares (Adam's exp_avg_sq): load_state_dict rejects a negative
  // value there, as it rejects a non-finite value in any buffer.
  virtual bool buffer_is_non_negative(const std::string& /*buffer*/) const { return false; }
  // One parameter's part of a step: `grad` is contiguous and of param's dtype, shape and device; `state`
  // has every buffer of buffer_names() (zero-filled on the first update) and its step already counts this
  // update (1 on the first).
  struct PendingUpdate {
    const ParamGroup* group;
    Tensor param, grad;
    ParamState* state;
  };
  // Applies every update of one step (all parameters that have a gradient), under NoGradGuard.
  virtual void update(const std::vector<PendingUpdate>& updates) = 0;

  // The optimizer's own hyperparameters as metadata entries, and their inverse. load_options must parse
  // and check every entry before it assigns any (load_state_dict relies on it changing nothing on error).
  virtual std::map<std::string, std::string> options_metadata() const = 0;
  virtual void load_options(const std::map<std::string, std::string>& metadata) = 0;

  // Metadata helpers: exact text for doubles, and parsers that throw an Error naming the entry.
  static std::string format_number(double value);
  double read_number(const std::map<std::string, std::string>& metadata, const std::string& key) const;
  int64_t read_integer(const std::map<std::string, std::string>& metadata, const std::string& key) const;
  bool read_bool(const std::map<std::string, std::string>& metadata, const std::string& key) const;

 private:
  void check_group(const ParamGroup& group, const std::vector<Tensor>& others) const;
  void check_for_step(const Tensor& param, const Tensor& grad, int64_t index) const;

  const char* name_;
  std::vector<ParamGroup> groups_;
  // Keyed by the parameter's impl (as PyTorch keys by the tensor object); the shared_ptr keeps the key
  // alive, so a freed parameter's address can never be mistaken for a new one's.
  std::map<std::shared_ptr<TensorImpl>, ParamState> state_;
};

}  // namespace mixtape
