// flashcore's native autograd node for the torch eager fast path (host C++, no device code).
//
// The torch backend records, for each layout and set of options it has run in full, the
// kernel launches that the call amounted to (flashcore/kernels/plans.py: kernels, geometry, the
// FlashParams struct with its pointer fields noted). Replaying such a record from Python costs
// tens of microseconds per step through torch.autograd: the Python autograd.Function, its
// backward run under the GIL on the engine's device thread, and the Python of the replay. This
// file moves the replay and the autograd node to C++:
//
//   flashcore_native::attention(q, k, v, alibi_slopes?, entry) -> (out, lse)
//       a torch::autograd::Function: allocates out and lse, fills the recorded struct with the
//       pointers, launches the recorded kernels with cuLaunchKernel on torch's current stream,
//       saves (q, k, v, out, lse[, alibi_slopes]). Its backward replays the backward record
//       attached to the entry when the incoming gradient and the saved tensors (as autograd
//       hands them back: saved-tensor hooks may change their layout) have the layouts that
//       record was made for; otherwise it calls flashcore_native::bwd_miss, implemented in
//       Python, which runs the backward in full (validation, launchers) and attaches a new
//       record. A forward whose record went stale in the meantime (another thread dropped the
//       plans) calls flashcore_native::fwd_miss, also Python, which runs the forward in full.
//
// Records are made in Python (torch_backend._Entry) and handed over with set_entry: launches as
// (CUfunction, grid, block, shared memory), the struct's bytes, the word index of each pointer
// field. An entry id stays valid for the life of the process; set_entry overwrites it in place.
// Whenever Python drops its launch plans (tile overrides, kernel reloads, the cache cap) it calls
// invalidate(): every record made before that is treated as missing from then on. (The Python
// side also keeps each record's kernels alive until the record is overwritten, so a launch that
// raced with a drop still finds its module loaded.)
//
// The driver API is reached through dlopen/dlsym of libcuda (already loaded by CuPy and torch),
// and torch's current stream through c10's device-guard interface: the file needs torch's
// headers and a C++17 compiler, nothing from the CUDA toolkit, and compiles in seconds.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace flashcore_native {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- the driver entry points --------------------------------------------------------------

typedef int CUresult;
typedef void* CUfunction;
typedef void* CUstream;
typedef void* CUcontext;
typedef CUresult (*LaunchKernelFn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   unsigned, unsigned, CUstream, void**, void**);
typedef CUresult (*CtxGetCurrentFn)(CUcontext*);
typedef CUresult (*CtxPushFn)(CUcontext);
typedef CUresult (*CtxPopFn)(CUcontext*);
typedef CUresult (*GetErrorStringFn)(CUresult, const char**);

struct Driver {
  LaunchKernelFn launch = nullptr;
  CtxGetCurrentFn ctx_get = nullptr;
  CtxPushFn ctx_push = nullptr;
  CtxPopFn ctx_pop = nullptr;
  GetErrorStringFn error_string = nullptr;
  std::string why;   // empty when every entry point was found
};

static const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) {
      r.why = "libcuda.so.1 could not be loaded";
      return r;
    }
    r.launch = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
    r.ctx_get = reinterpret_cast<CtxGetCurrentFn>(dlsym(lib, "cuCtxGetCurrent"));
    r.ctx_push = reinterpret_cast<CtxPushFn>(dlsym(lib, "cuCtxPushCurrent_v2"));
    r.ctx_pop = reinterpret_cast<CtxPopFn>(dlsym(lib, "cuCtxPopCurrent_v2"));
    r.error_string = reinterpret_cast<GetErrorStringFn>(dlsym(lib, "cuGetErrorString"));
    if (!r.launch || !r.ctx_get || !r.ctx_push || !r.ctx_pop || !r.error_string)
      r.why = "libcuda.so.1 lacks an entry point flashcore needs";
    return r;
  }();
  return d;
}

static void check_cu(CUresult r, const char* what) {
  if (r == 0) return;
  const char* s = nullptr;
  driver().error_string(r, &s);
  TORCH_CHECK(false, "flashcore: ", what, " failed: CUDA driver error ", r, " (",
              s ? s : "unknown", ")");
}

// ---- records --------------------------------------------------------------------------------

struct Launch {
  CUfunction f;
  unsigned gx, gy, gz, bx, by, bz, smem;
};

// A layout key of a tensor: sizes, strides, dtype, device and the address modulo 16.
static std::vector<int64_t> layout_of(const at::Tensor& t) {
  std::vector<int64_t> key;
  key.reserve(2 * t.dim() + 4);
  key.push_back(t.dim());
  for (auto s : t.sizes()) key.push_back(s);
  for (auto s : t.strides()) key.push_back(s);
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(t.device().index());
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16));
  return key;
}

struct Entry {
  std::mutex mu;
  int64_t generation = -1;          // -1: never set
  std::vector<uint64_t> words;      // the FlashParams struct, in 8-byte words
  std::vector<Launch> launches;
  std::vector<int64_t> slots;       // word index of each pointer (in the caller's order), then
                                    // of each scratch buffer
  int64_t npointers = 0;
  std::vector<int64_t> scratch_offsets;   // byte offsets into one float32 allocation
  int64_t scratch_floats = 0;
  bool scratch_zero = false;
  std::vector<int64_t> out_mods;    // address modulo 16 of the outputs the record was made with
  std::vector<int64_t> lse_shape;   // forward records: lse's shape
  bool out_like_q = false;          // forward records: out = empty_like(q) gives the recorded out
  int64_t device = 0;
  CUcontext ctx = nullptr;
  // forward records: the backward record to replay, and the layouts it is for (the incoming
  // gradient's, then the saved q, k, v, out, lse and alibi_slopes')
  int64_t bwd = -1;
  std::vector<int64_t> bwd_key;
};

static std::mutex g_mu;
static std::vector<std::unique_ptr<Entry>> g_entries;
static std::atomic<int64_t> g_generation{0};

static Entry& entry(int64_t id) {
  std::lock_guard<std::mutex> g(g_mu);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(g_entries.size()),
              "flashcore: no native record with id ", id);
  return *g_entries[id];
}

static int64_t new_entry() {
  std::lock_guard<std::mutex> g(g_mu);
  g_entries.push_back(std::make_unique<Entry>());
  return static_cast<int64_t>(g_entries.size()) - 1;
}

static void set_entry(int64_t id, const at::Tensor& words, at::IntArrayRef launches,
                      at::IntArrayRef slots, int64_t npointers, at::IntArrayRef scratch_offsets,
                      int64_t scratch_floats, bool scratch_zero, at::IntArrayRef out_mods,
                      at::IntArrayRef lse_shape, bool out_like_q, int64_t device, int64_t ctx) {
  TORCH_CHECK(words.device().is_cpu() && words.scalar_type() == at::kLong && words.dim() == 1 &&
                  words.is_contiguous(),
              "flashcore: set_entry: words must be a contiguous 1-d int64 CPU tensor");
  TORCH_CHECK(launches.size() % 8 == 0 && !launches.empty(),
              "flashcore: set_entry: launches must hold 8 integers per launch");
  TORCH_CHECK(npointers >= 0 && npointers <= static_cast<int64_t>(slots.size()),
              "flashcore: set_entry: npointers out of range");
  TORCH_CHECK(static_cast<int64_t>(slots.size()) - npointers ==
                  static_cast<int64_t>(scratch_offsets.size()),
              "flashcore: set_entry: one slot per scratch buffer expected");
  const int64_t nwords = words.numel();
  for (auto s : slots)
    TORCH_CHECK(s >= 0 && s < nwords, "flashcore: set_entry: slot ", s, " outside the struct");
  Entry& e = entry(id);
  std::lock_guard<std::mutex> g(e.mu);
  const auto* w = words.data_ptr<int64_t>();
  e.words.assign(reinterpret_cast<const uint64_t*>(w), reinterpret_cast<const uint64_t*>(w) + nwords);
  e.launches.clear();
  for (size_t i = 0; i < launches.size(); i += 8) {
    Launch l;
    l.f = reinterpret_cast<CUfunction>(static_cast<uintptr_t>(launches[i]));
    l.gx = static_cast<unsigned>(launches[i + 1]);
    l.gy = static_cast<unsigned>(launches[i + 2]);
    l.gz = static_cast<unsigned>(launches[i + 3]);
    l.bx = static_cast<unsigned>(launches[i + 4]);
    l.by = static_cast<unsigned>(launches[i + 5]);
    l.bz = static_cast<unsigned>(launches[i + 6]);
    l.smem = static_cast<unsigned>(launches[i + 7]);
    e.launches.push_back(l);
  }
  e.slots.assign(slots.begin(), slots.end());
  e.npointers = npointers;
  e.scratch_offsets.assign(scratch_offsets.begin(), scratch_offsets.end());
  e.scratch_floats = scratch_floats;
  e.scratch_zero = scratch_zero;
  e.out_mods.assign(out_mods.begin(), out_mods.end());
  e.lse_shape.assign(lse_shape.begin(), lse_shape.end());
  e.out_like_q = out_like_q;
  e.device = device;
  e.ctx = reinterpret_cast<CUcontext>(static_cast<uintptr_t>(ctx));
  e.bwd = -1;           // a new forward record: its backward is recorded anew
  e.bwd_key.clear();
  e.generation = g_generation.load();
}

// The layouts a backward record depends on: dout, q, k, v, out, lse, alibi_slopes (undefined: -1).
static std::vector<int64_t> backward_key(at::TensorList ts) {
  std::vector<int64_t> key;
  for (const auto& t : ts) {
    if (!t.defined()) {
      key.push_back(-1);
      continue;
    }
    auto k = layout_of(t);
    key.insert(key.end(), k.begin(), k.end());
  }
  return key;
}

static void set_backward(int64_t fwd, int64_t bwd, at::TensorList dout_q_k_v_out_lse_alibi) {
  TORCH_CHECK(dout_q_k_v_out_lse_alibi.size() == 7,
              "flashcore: set_backward takes dout, q, k, v, out, lse, alibi_slopes");
  Entry& e = entry(fwd);
  entry(bwd);   // (checks the id)
  auto key = backward_key(dout_q_k_v_out_lse_alibi);
  std::lock_guard<std::mutex> g(e.mu);
  e.bwd = bwd;
  e.bwd_key = std::move(key);
}

static void invalidate() { g_generation.fetch_add(1); }

static bool current(const Entry& e) { return e.generation == g_generation.load(); }

// What the tests read back: the struct words, then per launch its 8 integers.
static std::vector<int64_t> entry_state(int64_t id) {
  Entry& e = entry(id);
  std::lock_guard<std::mutex> g(e.mu);
  std::vector<int64_t> r;
  r.push_back(static_cast<int64_t>(e.words.size()));
  for (auto w : e.words) r.push_back(static_cast<int64_t>(w));
  for (const auto& l : e.launches) {
    r.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(l.f)));
    for (auto x : {l.gx, l.gy, l.gz, l.bx, l.by, l.bz, l.smem}) r.push_back(x);
  }
  r.push_back(current(e) ? 1 : 0);
  r.push_back(e.bwd);
  return r;
}

static uint64_t addr(const at::Tensor& t) {
  return t.defined() ? static_cast<uint64_t>(reinterpret_cast<uintptr_t>(t.data_ptr())) : 0;
}

// Fill the record's struct with `ptrs` (in the record's pointer order) and launch its kernels on
// torch's current stream of the record's device; false (nothing launched) when the record is no
// longer current. The caller holds a DeviceGuard on that device.
static bool launch(Entry& e, const std::vector<uint64_t>& ptrs, const at::TensorOptions& opts) {
  const Driver& d = driver();
  TORCH_CHECK(d.why.empty(), "flashcore: ", d.why);
  at::Tensor scratch;
  std::lock_guard<std::mutex> g(e.mu);
  if (!current(e)) return false;
  TORCH_CHECK(static_cast<int64_t>(ptrs.size()) == e.npointers,
              "flashcore: internal error: pointer count of a native record");
  for (int64_t i = 0; i < e.npointers; ++i) e.words[e.slots[i]] = ptrs[i];
  if (!e.scratch_offsets.empty()) {
    // one allocation for all of the record's scratch, on the current stream (freed after the
    // launches are queued: the caching allocator reuses it in stream order)
    auto fo = opts.dtype(at::kFloat);
    scratch = e.scratch_zero ? at::zeros({e.scratch_floats}, fo) : at::empty({e.scratch_floats}, fo);
    const uint64_t base = addr(scratch);
    for (size_t j = 0; j < e.scratch_offsets.size(); ++j)
      e.words[e.slots[e.npointers + j]] = base + static_cast<uint64_t>(e.scratch_offsets[j]);
  }
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  auto stream = impl.getStream(c10::Device(c10::DeviceType::CUDA,
                                           static_cast<c10::DeviceIndex>(e.device)));
  CUstream s = static_cast<CUstream>(stream.native_handle());
  CUcontext cur = nullptr;
  check_cu(d.ctx_get(&cur), "cuCtxGetCurrent");
  const bool push = cur != e.ctx;
  if (push) check_cu(d.ctx_push(e.ctx), "cuCtxPushCurrent");
  void* argv[1] = {e.words.data()};   // the struct is the kernels' one (by-value) parameter
  CUresult r = 0;
  for (const auto& l : e.launches) {
    r = d.launch(l.f, l.gx, l.gy, l.gz, l.bx, l.by, l.bz, l.smem, s, argv, nullptr);
    if (r != 0) break;
  }
  if (push) {
    CUcontext popped = nullptr;
    d.ctx_pop(&popped);
  }
  check_cu(r, "cuLaunchKernel");
  return true;
}

// ---- the autograd node ------------------------------------------------------------------

struct FlashAttention : public torch::autograd::Function<FlashAttention> {
  // (alibi_slopes optional: an undefined at::Tensor would count as a variable input)
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& alibi_slopes,
                               int64_t id) {
    const at::Tensor alibi = alibi_slopes.has_value() ? *alibi_slopes : at::Tensor();
    Entry& e = entry(id);
    bool usable;
    bool like_q;
    std::vector<int64_t> lse_shape, mods;
    {
      std::lock_guard<std::mutex> g(e.mu);
      usable = current(e);
      like_q = e.out_like_q;
      lse_shape = e.lse_shape;
      mods = e.out_mods;
    }
    at::Tensor out, lse;
    if (usable) {
      c10::DeviceGuard guard(q.device());
      out = like_q ? at::empty_like(q) : at::empty(q.sizes(), q.options());
      lse = at::empty(lse_shape, q.options().dtype(at::kFloat));
      usable = mods.size() == 2 && static_cast<int64_t>(addr(out) % 16) == mods[0] &&
               static_cast<int64_t>(addr(lse) % 16) == mods[1];
      // (launch re-checks that the record is current, under its lock)
      if (usable) usable = launch(e, {addr(q), addr(k), addr(v), addr(out), addr(lse), addr(alibi)},
                                  q.options());
    }
    if (!usable) {   // stale (plans dropped since the caller looked) or outputs of another alignment
      static auto op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("flashcore_native::fwd_miss", "")
                           .typed<std::tuple<at::Tensor, at::Tensor>(
                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, int64_t)>();
      std::tie(out, lse) = op.call(q, k, v, alibi_slopes, id);
    }
    ctx->save_for_backward({q, k, v, out, lse, alibi});
    ctx->saved_data["id"] = id;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3],
                     &lse = saved[4], &alibi = saved[5];
    const int64_t id = ctx->saved_data["id"].toInt();
    at::Tensor dout = grads[0];
    if (dout.size(-1) > 1 && dout.stride(-1) != 1) dout = dout.contiguous();
    at::Tensor dq, dk, dv;
    bool done = false;
    if (!c10::GradMode::is_enabled()) {   // (create_graph: Python refuses when differentiated)
      Entry& e = entry(id);
      const auto key = backward_key({dout, q, k, v, out, lse, alibi});
      int64_t bwd = -1;
      {
        std::lock_guard<std::mutex> g(e.mu);
        if (current(e) && e.bwd >= 0 && e.bwd_key == key) bwd = e.bwd;
      }
      if (bwd >= 0) {
        Entry& b = entry(bwd);
        std::vector<int64_t> mods;
        {
          std::lock_guard<std::mutex> g(b.mu);
          mods = b.out_mods;
        }
        c10::DeviceGuard guard(q.device());
        dq = at::empty_like(q);
        dk = at::empty_like(k);
        dv = at::empty_like(v);
        if (mods.size() == 3 && static_cast<int64_t>(addr(dq) % 16) == mods[0] &&
            static_cast<int64_t>(addr(dk) % 16) == mods[1] &&
            static_cast<int64_t>(addr(dv) % 16) == mods[2])
          done = launch(b, {addr(q), addr(k), addr(v), addr(out), addr(lse), addr(dout), addr(dq),
                            addr(dk), addr(dv), addr(alibi)},
                        q.options());
      }
    }
    if (!done) {
      static auto op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("flashcore_native::bwd_miss", "")
                           .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, int64_t)>();
      std::optional<at::Tensor> a;
      if (alibi.defined()) a = alibi;
      std::tie(dq, dk, dv) = op.call(dout, q, k, v, out, lse, a, id);
    }
    return {dq, dk, dv, at::Tensor(), at::Tensor()};
  }
};

static std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v,
                                                    const std::optional<at::Tensor>& alibi,
                                                    int64_t id) {
  auto r = FlashAttention::apply(q, k, v, alibi, id);
  return {r[0], r[1]};
}

static std::string driver_status() { return driver().why; }

}  // namespace flashcore_native

TORCH_LIBRARY(flashcore_native, m) {
  using namespace flashcore_native;
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? alibi_slopes, int entry) -> (Tensor, Tensor)");
  m.impl("attention", c10::DispatchKey::CompositeImplicitAutograd, TORCH_FN(attention));
  // implemented in Python (flashcore/backends/torch_native.py)
  m.def("bwd_miss(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? alibi_slopes, int entry) -> (Tensor, Tensor, Tensor)");
  m.def("fwd_miss(Tensor q, Tensor k, Tensor v, Tensor? alibi_slopes, int entry) -> (Tensor, Tensor)");
  m.def("new_entry() -> int", TORCH_FN(new_entry));
  m.def("set_entry(Tensor words, int[] launches, int[] slots, int npointers, "
        "int[] scratch_offsets, int scratch_floats, bool scratch_zero, int[] out_mods, "
        "int[] lse_shape, bool out_like_q, int device, int ctx, int entry) -> ()",
        [](const at::Tensor& words, at::IntArrayRef launches, at::IntArrayRef slots,
           int64_t npointers, at::IntArrayRef scratch_offsets, int64_t scratch_floats,
           bool scratch_zero, at::IntArrayRef out_mods, at::IntArrayRef lse_shape,
           bool out_like_q, int64_t device, int64_t ctx, int64_t id) {
          set_entry(id, words, launches, slots, npointers, scratch_offsets, scratch_floats,
                    scratch_zero, out_mods, lse_shape, out_like_q, device, ctx);
        });
  m.def("set_backward(int fwd, int bwd, Tensor?[] dout_q_k_v_out_lse_alibi) -> ()",
        [](int64_t fwd, int64_t bwd, const c10::List<std::optional<at::Tensor>>& ts) {
          std::vector<at::Tensor> v;
          for (const std::optional<at::Tensor>& t : ts) v.push_back(t.has_value() ? *t : at::Tensor());
          set_backward(fwd, bwd, v);
        });
  m.def("invalidate() -> ()", TORCH_FN(invalidate));
  m.def("entry_state(int entry) -> int[]", TORCH_FN(entry_state));
  m.def("driver_status() -> str", TORCH_FN(driver_status));
}
