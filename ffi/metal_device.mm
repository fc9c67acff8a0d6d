// The Metal device: runs the shaders/*.metal kernels on the Apple GPU. XLA:CPU calls the FFI
// handlers with host buffers; on Apple silicon the GPU shares that memory, so buffers are
// wrapped in place (page-aligned region + offset) or, when Metal refuses, staged through shared
// buffers from a pool. Small read-only arrays (the lengths) are copied into the command with
// setBytes.
//
// Only Apple-silicon GPUs are accepted (apple_gpu_gate in device.h): the kernels assume 32-wide
// simdgroups and would give wrong results elsewhere. The GPU is looked for with MTLCopyAllDevices
// first, then MTLCreateSystemDefaultDevice (discover_device); when none qualifies, the reason
// names what each call found.
//
// Shader libraries are compiled lazily from the embedded source, one (source file, dtype, head
// dim) family at a time (JFM_IF_FAMILY in shaders/flash_attention_common.h), so a model pays
// only for the kernels it uses. Compile warnings are kept (library_warnings) and printed once
// to stderr.
//
// Each submission is one command buffer with one concurrent compute encoder: dispatches between
// two buffer memory barriers (Dispatch::barrier_before, set by mark_barriers in
// dispatch_plan.h) may overlap. A failed command buffer names the kernels it held; with
// $JAX_FLASH_METAL_DEBUG (metal_debug() in device.h) it is created with encoder execution status
// and a debug signpost per dispatch, and the error also gives the encoder's status (Apple says
// that option may cost CPU and GPU time, so it is off by default).
// The GPU core count comes from the IORegistry ("gpu-core-count" of the AGXAccelerator service,
// as metal-flash-attention reads it), else from a table of chip names.
// The GPU time of every completed command buffer (GPUEndTime - GPUStartTime) refines the
// throughput estimate that sizes later submissions (dispatch_plan.h) and is added to a
// process-wide total (metal_gpu_seconds_total, for the benchmark).
//
// Memory management: ARC (this file is compiled with -fobjc-arc; there is no manual
// retain/release of Objective-C objects; the IOKit and CoreFoundation objects of
// registry_gpu_cores, which ARC does not manage, are released there). Every method that touches Metal objects runs inside @autoreleasepool.
// Thread safety: the kernel index (kernel name -> its library slot and pipeline slots) is built
// at construction and only read afterwards, so a call finds its pipeline without a lock and
// without searching shader text; each library and each (kernel, function constants) pipeline is
// built once by std::call_once on its own slot, so a compile blocks only calls that need that
// same library or pipeline. Compile messages have a mutex held only to append or read them; the
// staging pool has its own; the throughput estimate and the GPU-time total are atomic;
// MTLCommandQueue is itself thread-safe, so handlers may run concurrently. A call never waits
// for the GPU: run_async commits its command buffers and returns; their completion handlers
// finish it (Call), and its `done` runs on a global dispatch queue.
#import <Foundation/Foundation.h>
#import <IOKit/IOKitLib.h>
#import <Metal/Metal.h>
#include <dispatch/dispatch.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "device.h"
#include "../emulator/emulator.h"
#include "shader_sources.h"
#include "working_memory.h"

// Encoder status of an injected fault (set_metal_fault): stands in for what Metal reports in
// MTLCommandBufferEncoderInfoErrorKey, so the injected error takes the real error's path.
@interface JfmInjectedEncoderInfo : NSObject <MTLCommandBufferEncoderInfo>
- (instancetype)initWithLabel:(NSString*)label
                    signposts:(NSArray<NSString*>*)signposts
                        state:(MTLCommandEncoderErrorState)state;
@end

@implementation JfmInjectedEncoderInfo {
  NSString* _label;
  NSArray<NSString*>* _signposts;
  MTLCommandEncoderErrorState _state;
}

- (instancetype)initWithLabel:(NSString*)label
                    signposts:(NSArray<NSString*>*)signposts
                        state:(MTLCommandEncoderErrorState)state {
  self = [super init];
  if (self != nil) {
    _label = [label copy];
    _signposts = [signposts copy];
    _state = state;
  }
  return self;
}

- (NSString*)label {
  return _label;
}

- (NSArray<NSString*>*)debugSignposts {
  return _signposts;
}

- (MTLCommandEncoderErrorState)errorState {
  return _state;
}
@end

namespace jfm {
namespace {

// setBytes is for data up to 4 KB (Apple's guidance); larger copies go through a buffer.
constexpr size_t kMaxSetBytes = 4096;

FaultKernel g_fault;  // set_metal_fault

// A dispatch's label in error messages and debug signposts: "<kernel> groups [x, y, z]".
std::string dispatch_label(const Dispatch& d) {
  return d.kernel + " groups [" + std::to_string(d.groups[0]) + ", " +
         std::to_string(d.groups[1]) + ", " + std::to_string(d.groups[2]) + "]";
}

std::string utf8(NSString* text) { return text != nil ? std::string(text.UTF8String) : ""; }

NSString* ns(const std::string& text) { return [NSString stringWithUTF8String:text.c_str()]; }

std::string joined(const std::vector<std::string>& items) {
  std::string text;
  for (const std::string& item : items) text += (text.empty() ? "" : ", ") + item;
  return text;
}

// The "gpu-core-count" property of the GPU's AGXAccelerator service in the IORegistry (Apple
// silicon has one GPU), 0 when there is none or it is not a number.
long registry_gpu_cores() {
  const io_service_t service =
      IOServiceGetMatchingService(kIOMainPortDefault, IOServiceMatching("AGXAccelerator"));
  if (service == IO_OBJECT_NULL) return 0;
  long cores = 0;
  CFTypeRef value = IORegistryEntryCreateCFProperty(service, CFSTR("gpu-core-count"),
                                                    kCFAllocatorDefault, 0);
  if (value != nullptr) {
    if (CFGetTypeID(value) == CFNumberGetTypeID() &&
        !CFNumberGetValue(static_cast<CFNumberRef>(value), kCFNumberLongType, &cores)) {
      cores = 0;
    }
    CFRelease(value);
  }
  IOObjectRelease(service);
  return cores;
}

std::string describe(NSError* error) {
  if (error == nil) return "unknown error";
  std::string text = utf8(error.localizedDescription);
  return text.empty() ? "unknown error" : text;
}

const char* state_name(MTLCommandEncoderErrorState state) {
  switch (state) {
    case MTLCommandEncoderErrorStateCompleted:
      return "completed";
    case MTLCommandEncoderErrorStateAffected:
      return "affected";
    case MTLCommandEncoderErrorStatePending:
      return "pending";
    case MTLCommandEncoderErrorStateFaulted:
      return "faulted";
    case MTLCommandEncoderErrorStateUnknown:
      break;
  }
  return "unknown";
}

// A failed command buffer's error: Metal's description and code, then the status of its
// encoder and the dispatches it recorded (debug mode), or else the dispatches it held.
std::string failure_message(NSError* error, const std::vector<std::string>& labels) {
  std::string message = "command buffer failed: " + describe(error);
  if (error != nil) message += " (MTLCommandBufferError " + std::to_string(error.code) + ")";
  id infos = error != nil ? error.userInfo[MTLCommandBufferEncoderInfoErrorKey] : nil;
  std::string encoders;
  if ([infos isKindOfClass:[NSArray class]]) {
    for (id<MTLCommandBufferEncoderInfo> info in (NSArray*)infos) {
      if (!encoders.empty()) encoders += ", ";
      encoders += utf8(info.label) + " [" + state_name(info.errorState) + "]";
      std::vector<std::string> signposts;
      for (NSString* signpost in info.debugSignposts) signposts.push_back(utf8(signpost));
      if (!signposts.empty()) encoders += " (dispatches: " + joined(signposts) + ")";
    }
  }
  if (!encoders.empty()) return message + "; encoders: " + encoders;
  return message + "; kernels in it: " + joined(labels) +
         " (set JAX_FLASH_METAL_DEBUG=1 for the encoder's execution status)";
}

// The error an injected fault reports: with execution status (debug mode), the encoder faulted,
// its signposts naming the dispatches; without, Metal would give no encoder status.
NSError* injected_error(const std::string& encoder_label, const std::vector<std::string>& labels,
                        bool execution_status) {
  NSMutableDictionary* info = [NSMutableDictionary
      dictionaryWithObject:@"injected fault (test hook)"
                    forKey:NSLocalizedDescriptionKey];
  if (execution_status) {
    NSMutableArray<NSString*>* signposts = [NSMutableArray array];
    for (const std::string& label : labels) [signposts addObject:ns(label)];
    info[MTLCommandBufferEncoderInfoErrorKey] = @[ [[JfmInjectedEncoderInfo alloc]
        initWithLabel:ns(encoder_label)
            signposts:signposts
                state:MTLCommandEncoderErrorStateFaulted] ];
  }
  return [NSError errorWithDomain:MTLCommandBufferErrorDomain
                             code:MTLCommandBufferErrorInternal
                         userInfo:info];
}

// Shared-storage staging buffers, reused across calls, for host memory Metal cannot wrap.
class StagingPool {
 public:
  explicit StagingPool(id<MTLDevice> device) : device_(device) {}

  // A buffer of at least `size` bytes (at most twice that when reused), or nil.
  id<MTLBuffer> acquire(size_t size) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.lower_bound(size);
      if (it != free_.end() && it->first <= 2 * size) {
        id<MTLBuffer> buffer = it->second;
        cached_bytes_ -= it->first;
        free_.erase(it);
        return buffer;
      }
    }
    return [device_ newBufferWithLength:size options:MTLResourceStorageModeShared];
  }

  void release(id<MTLBuffer> buffer) {
    const size_t size = buffer.length;
    std::lock_guard<std::mutex> lock(mutex_);
    if (cached_bytes_ + size > kMaxCachedBytes) return;  // dropped: ARC frees it
    cached_bytes_ += size;
    free_.emplace(size, buffer);
  }

 private:
  static constexpr size_t kMaxCachedBytes = size_t{256} << 20;
  id<MTLDevice> device_;
  std::mutex mutex_;
  std::multimap<size_t, id<MTLBuffer>> free_;  // by length
  size_t cached_bytes_ = 0;
};

// One library (a family of one source, or a whole source), compiled on first use.
struct LibrarySlot {
  ShaderLibrary spec;
  std::once_flag once;
  id<MTLLibrary> library = nil;  // nil: not compiled yet, or failed
};

// One pipeline of a kernel, for one function-constant set.
struct PipelineSlot {
  std::once_flag once;
  id<MTLComputePipelineState> state = nil;
  std::string error;  // why state is nil after the once-call
};

// A kernel: its library and one pipeline slot per function-constant set.
struct KernelSlots {
  LibrarySlot* library;
  std::array<PipelineSlot, size_t{1} << kFunctionConstants> pipelines;
};

// The kernels the embedded sources instantiate, known without compiling them (the same
// shaders/*.metal files were translated for the emulator at build time, so its list holds them,
// with the emulator's own test kernels, which no embedded source names), each with the slot of
// its library: the one source search, at construction.
struct KernelIndex {
  std::vector<std::string> names;  // sorted, as emu::kernel_names()
  std::vector<std::unique_ptr<LibrarySlot>> libraries;
  std::unordered_map<std::string, std::unique_ptr<KernelSlots>> kernels;
};

KernelIndex kernel_index(const std::vector<ShaderSource>& sources) {
  KernelIndex index;
  std::unordered_map<std::string, LibrarySlot*> by_key;  // "file:family"
  for (const std::string& name : emu::kernel_names()) {
    ShaderLibrary spec = shader_library(sources, name);
    if (spec.source == nullptr) continue;
    index.names.push_back(name);
    const std::string key = std::string(spec.source->file) + ":" + spec.family;
    LibrarySlot*& library = by_key[key];
    if (library == nullptr) {
      index.libraries.push_back(std::make_unique<LibrarySlot>());
      library = index.libraries.back().get();
      library->spec = std::move(spec);
    }
    auto slots = std::make_unique<KernelSlots>();
    slots->library = library;
    index.kernels.emplace(name, std::move(slots));
  }
  return index;
}

class MetalDevice final : public Device {
 public:
  MetalDevice(id<MTLDevice> device, id<MTLCommandQueue> queue, MTLLanguageVersion language)
      : device_(device),
        queue_(queue),
        language_(language),
        name_(utf8(device.name)),
        page_size_(static_cast<uintptr_t>(sysconf(_SC_PAGESIZE))),
        staging_(device),
        index_(kernel_index(sources_)),
        gpu_cores_(gpu_core_count(registry_gpu_cores(), name_)) {}

  const char* kind() const override { return "metal"; }
  std::string name() const override { return name_; }
  int gpu_cores() override { return gpu_cores_; }

  // Compiles the kernel's family on first use.
  bool has_kernel(const std::string& kernel) override {
    std::string error;
    return library_for(kernel, &error) != nil;
  }

  std::vector<std::string> kernel_names() override { return index_.names; }

  std::string library_error() override {
    std::lock_guard<std::mutex> lock(messages_mutex_);
    return library_error_;
  }

  std::string library_warnings() override {
    std::lock_guard<std::mutex> lock(messages_mutex_);
    return library_warnings_;
  }

  double multiply_adds_per_second() override { return throughput_.load(); }

  // Seconds of GPU time of every command buffer completed so far.
  double gpu_seconds_total() const { return gpu_seconds_.load(); }

  // Whether a pipeline failed the gate (not 32-wide simdgroups); lock-free, as every handler
  // call asks it.
  bool gate_failed() const { return gate_failed_.load(); }

  // Why Metal is unusable after gate_failed(), else "".
  std::string gate_failure() {
    std::lock_guard<std::mutex> lock(messages_mutex_);
    return gate_failure_;
  }

  // Encodes and commits every submission, then returns; the last command buffer to complete
  // (or this function, when none was committed) finishes the call on its thread.
  void run_async(std::vector<Submission> submissions, RunDone done) override {
    @autoreleasepool {
      auto call = std::make_shared<Call>();
      call->done = std::move(done);
      call->fault = g_fault.get();
      call->submissions = std::move(submissions);
      std::string error;
      for (const Submission& submission : call->submissions) {
        error = encode_and_commit(submission, call);
        if (!error.empty()) break;
      }
      call->encode_error = error;  // read by finish() only after the release below
      release(call);
    }
  }

 private:
  // A host range copied through a staging buffer.
  struct Staged {
    id<MTLBuffer> buffer;
    void* host;
    size_t size;
    bool copy_back;
  };

  // Where a host range is bound.
  struct Bound {
    id<MTLBuffer> buffer;
    NSUInteger offset;
    ptrdiff_t staged_index;  // into the Staged list, or -1 when wrapped in place
  };

  // A committed command buffer and the submission it holds (in its Call, which outlives it).
  // The labels are formatted only when needed (an error, debug mode), not on every call.
  struct Committed {
    id<MTLCommandBuffer> command_buffer;
    const Submission* submission;
    double multiply_adds;

    bool holds(const std::string& kernel) const {
      return std::any_of(submission->begin(), submission->end(),
                         [&](const Dispatch& d) { return d.kernel == kernel; });
    }
    std::vector<std::string> labels() const {
      std::vector<std::string> labels;
      for (const Dispatch& d : *submission) labels.push_back(dispatch_label(d));
      return labels;
    }
  };

  // An encoder's label: "jax_flash_metal" and the submission's kernels, each once.
  static std::string encoder_label(const Submission& submission) {
    std::vector<std::string> kernels;
    for (const Dispatch& d : submission) {
      if (std::find(kernels.begin(), kernels.end(), d.kernel) == kernels.end()) {
        kernels.push_back(d.kernel);
      }
    }
    return "jax_flash_metal " + joined(kernels);
  }

  // One run_async(): one Metal buffer per distinct host range for the whole call, so a range
  // written by one dispatch and read by a later one (the backward's delta), even in a later
  // command buffer on this queue, is the same hazard-tracked buffer. Shared by the encoding
  // thread and the completion handlers of its command buffers; `pending` counts the encoding
  // (1 until it ends) and each committed command buffer not yet completed, and whoever drops it
  // to 0 calls finish(). `committed`, `staged` and `ranges` change only while encoding holds its
  // count, so finish() reads them alone.
  struct Call {
    std::vector<Submission> submissions;  // never resized once encoding starts
    std::map<std::pair<void*, size_t>, Bound> ranges;
    std::vector<Staged> staged;
    std::vector<Committed> committed;
    std::atomic<int> pending{1};
    std::string encode_error;
    std::string fault;  // set_metal_fault's kernel when the call started
    RunDone done;
  };

  void release(const std::shared_ptr<Call>& call) {
    if (call->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(*call);
  }

  // Every command buffer of the call has completed: the first error (encoding, then each
  // command buffer in order; the GPU time of the good ones refines the estimate), the staged
  // results copied back, the staging buffers returned (their bytes recorded for
  // take_working_memory: working_memory.h), then `done`.
  void finish(Call& call) {
    @autoreleasepool {
      std::string error = call.encode_error;
      for (const Committed& c : call.committed) {
        if (!error.empty()) break;
        if (c.command_buffer.status != MTLCommandBufferStatusCompleted) {
          error = failure_message(c.command_buffer.error, c.labels());
        } else if (!call.fault.empty() && c.holds(call.fault)) {
          const bool status = (c.command_buffer.errorOptions &
                               MTLCommandBufferErrorOptionEncoderExecutionStatus) != 0;
          error = failure_message(
              injected_error(encoder_label(*c.submission), c.labels(), status), c.labels());
        } else {
          const double seconds = c.command_buffer.GPUEndTime - c.command_buffer.GPUStartTime;
          calibrate(c.multiply_adds, seconds);
          add_gpu_seconds(seconds);
        }
      }
      uint64_t staged_bytes = 0;  // the call's staging buffers, as allocated
      for (const Staged& s : call.staged) {
        if (error.empty() && s.copy_back) std::memcpy(s.host, s.buffer.contents, s.size);
        staged_bytes += s.buffer.length;
        staging_.release(s.buffer);
      }
      record_staging_bytes(staged_bytes);
      // The command buffers hold their completion blocks, which hold this call: let go of them.
      call.committed.clear();
      call.ranges.clear();
      call.staged.clear();
      // XLA resumes the program on the thread that completes its future: a global queue's, not
      // Metal's completion-handler thread, which other command buffers' handlers wait for.
      const RunDone done = std::move(call.done);
      dispatch_async(dispatch_get_global_queue(QOS_CLASS_USER_INITIATED, 0), ^{
        done(error);
      });
    }
  }

  // Measured GPU time of a command buffer: lower the estimate at once when the GPU was slower
  // than assumed (the watchdog is what the budget guards against), raise it gradually when it
  // was faster. Command buffers under a millisecond are mostly launch overhead and not used.
  void calibrate(double multiply_adds, double seconds) {
    if (!(seconds >= 1e-3) || multiply_adds <= 0) return;
    const double observed = multiply_adds / seconds;
    const double current = throughput_.load();
    const double next =
        observed < current ? observed : current * std::pow(observed / current, 0.25);
    throughput_.store(std::clamp(next, 1e8, 1e15));
  }

  // Adds to the GPU-time total (std::atomic<double> has no fetch_add before C++20).
  void add_gpu_seconds(double seconds) {
    if (!(seconds > 0)) return;
    double total = gpu_seconds_.load();
    while (!gpu_seconds_.compare_exchange_weak(total, total + seconds)) {
    }
  }

  // The slots of `kernel`, nullptr with `error` set when no embedded source defines it.
  KernelSlots* slots_of(const std::string& kernel, std::string* error) {
    auto it = index_.kernels.find(kernel);
    if (it != index_.kernels.end()) return it->second.get();
    *error = "no kernel '" + kernel + "' in the shader sources";
    return nullptr;
  }

  // The library of `slots`, compiled on first use; nil with `error` set when it failed.
  id<MTLLibrary> library_of(LibrarySlot& slot, std::string* error) {
    std::call_once(slot.once, [&] { slot.library = compile(slot.spec); });
    if (slot.library == nil) *error = "the shader library failed to compile: " + library_error();
    return slot.library;
  }

  // The library holding `kernel` (shader_library: its source, and its dtype and head-dim
  // family or the whole source), compiled on first use; nil with `error` set when the kernel
  // does not exist or its library failed to compile.
  id<MTLLibrary> library_for(const std::string& kernel, std::string* error) {
    KernelSlots* slots = slots_of(kernel, error);
    return slots == nullptr ? nil : library_of(*slots->library, error);
  }

  // Compiles one library (one family of one source, or all of it); records errors and warnings.
  id<MTLLibrary> compile(const ShaderLibrary& library) {
    @autoreleasepool {
      MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
      options.languageVersion = language_;
      // IEEE semantics for -inf/NaN and no reassociation. Results do not depend on this
      // setting's default function precision, which differs between macOS versions: the
      // kernels name fast:: or precise:: math functions explicitly (shaders/README.md).
#if defined(__MAC_15_0)
      if (@available(macOS 15.0, *)) {
        options.mathMode = MTLMathModeSafe;
      } else {
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
        options.fastMathEnabled = NO;
#pragma clang diagnostic pop
      }
#else
      options.fastMathEnabled = NO;
#endif
      if (!library.macros.empty()) {
        NSMutableDictionary<NSString*, NSObject*>* macros = [NSMutableDictionary dictionary];
        for (const auto& [name, value] : library.macros) macros[ns(name)] = ns(value);
        options.preprocessorMacros = macros;
      }
      const ShaderSource& source = *library.source;
      NSString* text = [[NSString alloc] initWithBytes:source.text
                                                length:source.size
                                              encoding:NSUTF8StringEncoding];
      NSError* error = nil;
      id<MTLLibrary> compiled = [device_ newLibraryWithSource:text options:options error:&error];
      const std::string what = std::string(source.file) +
                               (library.family.empty() ? "" : " (" + library.family + ")");
      std::lock_guard<std::mutex> lock(messages_mutex_);
      if (compiled == nil) {
        if (!library_error_.empty()) library_error_ += "\n";
        library_error_ += what + ": " + describe(error);
      } else if (error != nil) {  // compiled, with warnings
        const std::string warning = what + ": " + describe(error);
        library_warnings_ += (library_warnings_.empty() ? "" : "\n") + warning;
        std::fprintf(stderr, "jax_flash_metal: Metal shader compile warnings in %s\n",
                     warning.c_str());
      }
      return compiled;
    }
  }

  // The pipeline of `kernel` specialised with the bool function constants `constants` (bit n:
  // [[function_constant(n)]], shaders/function_constants.h), built once on first use; nil with
  // `error` set on failure. The hot path is one hash lookup in the read-only index.
  id<MTLComputePipelineState> pipeline(const std::string& kernel, uint32_t constants,
                                       std::string* error) {
    KernelSlots* slots = slots_of(kernel, error);
    if (slots == nullptr) return nil;
    if (constants >= slots->pipelines.size()) {
      *error = "kernel '" + kernel + "': unknown function constants " + std::to_string(constants);
      return nil;
    }
    PipelineSlot& slot = slots->pipelines[constants];
    std::call_once(slot.once, [&] { slot.state = build(kernel, *slots, constants, &slot.error); });
    if (slot.state == nil) *error = slot.error;
    return slot.state;
  }

  // Builds a pipeline (pipeline's once-call).
  id<MTLComputePipelineState> build(const std::string& kernel, KernelSlots& slots,
                                    uint32_t constants, std::string* error) {
    @autoreleasepool {
      id<MTLLibrary> library = library_of(*slots.library, error);
      if (library == nil) return nil;
      MTLFunctionConstantValues* values = [[MTLFunctionConstantValues alloc] init];
      for (NSUInteger n = 0; n < NSUInteger{kFunctionConstants}; ++n) {
        const bool value = ((constants >> n) & 1u) != 0;
        [values setConstantValue:&value type:MTLDataTypeBool atIndex:n];
      }
      NSError* ns_error = nil;
      id<MTLFunction> function = [library newFunctionWithName:ns(kernel)
                                               constantValues:values
                                                        error:&ns_error];
      if (function == nil) {
        *error = "could not load kernel '" + kernel + "' with function constants " +
                 std::to_string(constants) + ": " + describe(ns_error);
        return nil;
      }
      id<MTLComputePipelineState> state = [device_ newComputePipelineStateWithFunction:function
                                                                                 error:&ns_error];
      if (state == nil) {
        *error = "could not build the pipeline of '" + kernel + "': " + describe(ns_error);
        return nil;
      }
      const std::string gate = apple_gpu_gate(name_, true, true,
                                              static_cast<uint32_t>(state.threadExecutionWidth));
      if (!gate.empty()) {
        std::lock_guard<std::mutex> lock(messages_mutex_);
        gate_failure_ = gate + " (pipeline of '" + kernel + "')";
        gate_failed_.store(true);
        *error = gate_failure_;
        return nil;
      }
      return state;
    }
  }

  // Binds a host range: wrapped in place when Metal accepts the page-aligned region around it
  // (and `wrap` allows it) with the whole length (some virtual machines' Metal returns
  // zero-length buffers there), else through a staging buffer (copied in now unless the kernel
  // only writes it). newBufferWithBytesNoCopy takes a page-aligned pointer and a length that
  // is a whole number of pages (Apple's documentation of the method), hence the rounding out to
  // page boundaries and the offset into the wrapped region. Each range is wrapped once per call
  // (set_binding's Call::ranges).
  std::string bind(const Binding& binding, bool wrap, std::vector<Staged>* staged, Bound* bound) {
    const size_t size = std::max<size_t>(binding.size, 1);
    if (size > device_.maxBufferLength) {
      return "a buffer of " + std::to_string(size) + " bytes exceeds the device's limit of " +
             std::to_string(device_.maxBufferLength);
    }
    const uintptr_t address = reinterpret_cast<uintptr_t>(binding.data);
    const uintptr_t start = address & ~(page_size_ - 1);
    const uintptr_t end = (address + size + page_size_ - 1) & ~(page_size_ - 1);
    if (wrap && end - start <= device_.maxBufferLength) {
      id<MTLBuffer> wrapped = [device_ newBufferWithBytesNoCopy:reinterpret_cast<void*>(start)
                                                         length:end - start
                                                        options:MTLResourceStorageModeShared
                                                    deallocator:nil];
      if (wrapped != nil && wrapped.length >= end - start) {
        *bound = Bound{wrapped, static_cast<NSUInteger>(address - start), -1};
        return "";
      }
    }
    id<MTLBuffer> buffer = staging_.acquire(size);
    if (buffer == nil) {
      return "could not allocate a staging buffer of " + std::to_string(size) + " bytes";
    }
    if (!binding.written) std::memcpy(buffer.contents, binding.data, binding.size);
    staged->push_back(Staged{buffer, binding.data, binding.size, binding.written});
    *bound = Bound{buffer, 0, static_cast<ptrdiff_t>(staged->size() - 1)};
    return "";
  }

  // Sets one binding on the encoder: copied into the command (setBytes) when it is a small
  // copy, else the call's Metal buffer for its host range.
  std::string set_binding(id<MTLComputeCommandEncoder> encoder, const Binding& b, Call* call) {
    if (b.copy && b.size <= kMaxSetBytes) {
      [encoder setBytes:b.data length:std::max<size_t>(b.size, 1) atIndex:b.index];
      return "";
    }
    auto key = std::make_pair(b.data, b.size);
    auto it = call->ranges.find(key);
    if (it == call->ranges.end()) {
      Bound bound;
      std::string error = bind(b, !b.copy, &call->staged, &bound);
      if (!error.empty()) return error;
      it = call->ranges.emplace(key, bound).first;
    } else if (b.written && it->second.staged_index >= 0) {
      call->staged[it->second.staged_index].copy_back = true;
    }
    [encoder setBuffer:it->second.buffer offset:it->second.offset atIndex:b.index];
    return "";
  }

  // Encodes one dispatch: a buffer memory barrier first when it depends on earlier ones, in
  // debug mode a signpost with its label, then its pipeline, bindings and grid.
  std::string encode(id<MTLComputeCommandEncoder> encoder, const Dispatch& d, bool debug,
                     Committed* committed, Call* call) {
    std::string error;
    id<MTLComputePipelineState> state = pipeline(d.kernel, d.function_constants, &error);
    if (state == nil) return error;
    const NSUInteger threads = NSUInteger{d.group_size[0]} * d.group_size[1] * d.group_size[2];
    if (threads > state.maxTotalThreadsPerThreadgroup) {
      return "kernel '" + d.kernel + "' allows " +
             std::to_string(state.maxTotalThreadsPerThreadgroup) +
             " threads per threadgroup, the dispatch needs " + std::to_string(threads);
    }
    committed->multiply_adds += d.multiply_adds;
    if (d.barrier_before) [encoder memoryBarrierWithScope:MTLBarrierScopeBuffers];
    if (debug) [encoder insertDebugSignpost:ns(dispatch_label(d))];
    [encoder setComputePipelineState:state];
    for (const Binding& b : d.buffers) {
      error = set_binding(encoder, b, call);
      if (!error.empty()) return error;
    }
    if (!d.constants.empty()) {
      [encoder setBytes:d.constants.data() length:d.constants.size() atIndex:d.constants_index];
    }
    [encoder dispatchThreadgroups:MTLSizeMake(d.groups[0], d.groups[1], d.groups[2])
            threadsPerThreadgroup:MTLSizeMake(d.group_size[0], d.group_size[1], d.group_size[2])];
    return "";
  }

  // Encodes one submission into its own command buffer, one concurrent compute encoder labelled
  // with the submission's kernels, and commits it with a completion handler that releases the
  // call's count for it.
  std::string encode_and_commit(const Submission& submission,
                                const std::shared_ptr<Call>& call) {
    const bool debug = metal_debug();
    MTLCommandBufferDescriptor* descriptor = [[MTLCommandBufferDescriptor alloc] init];
    descriptor.errorOptions = debug ? MTLCommandBufferErrorOptionEncoderExecutionStatus
                                    : MTLCommandBufferErrorOptionNone;
    id<MTLCommandBuffer> command_buffer = [queue_ commandBufferWithDescriptor:descriptor];
    if (command_buffer == nil) return "could not create a command buffer";
    id<MTLComputeCommandEncoder> encoder =
        [command_buffer computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
    if (encoder == nil) return "could not create a compute command encoder";
    // The encoder's label shows in its execution status, which only debug mode asks for.
    if (debug) encoder.label = ns(encoder_label(submission));
    Committed committed{command_buffer, &submission, 0};
    std::string error;
    for (const Dispatch& d : submission) {
      error = encode(encoder, d, debug, &committed, call.get());
      if (!error.empty()) break;
    }
    [encoder endEncoding];
    if (!error.empty()) return error;  // never commit a partly encoded submission
    call->committed.push_back(std::move(committed));
    call->pending.fetch_add(1, std::memory_order_relaxed);
    // Added before commit, as Metal requires; the block holds the call, not the command buffer.
    std::shared_ptr<Call> held = call;
    [command_buffer addCompletedHandler:^(id<MTLCommandBuffer>) {
      release(held);
    }];
    [command_buffer commit];
    return "";
  }

  id<MTLDevice> device_;
  id<MTLCommandQueue> queue_;
  const MTLLanguageVersion language_;
  const std::string name_;
  const uintptr_t page_size_;
  const std::vector<ShaderSource> sources_ = shader_sources();
  StagingPool staging_;
  const KernelIndex index_;  // read-only after construction
  const int gpu_cores_;
  std::atomic<double> throughput_{kInitialMultiplyAddsPerSecond};
  std::atomic<bool> gate_failed_{false};
  std::atomic<double> gpu_seconds_{0.0};

  std::mutex messages_mutex_;  // guards the three messages below (never held while compiling)
  std::string library_error_;
  std::string library_warnings_;
  std::string gate_failure_;
};

struct MetalState {
  MetalDevice* device = nullptr;  // lives for the whole process
  std::string unavailable_reason;
};

// Why `device` cannot run the kernels ("" when it can): apple_gpu_gate on its traits.
std::string device_gate(id<MTLDevice> device) {
  return apple_gpu_gate(utf8(device.name), [device supportsFamily:MTLGPUFamilyApple7],
                        device.hasUnifiedMemory, 0);
}

// The GPU the kernels run on: the first qualifying device of MTLCopyAllDevices (macOS-only API,
// MTLDevice.h: it lists every GPU and does not depend on a display), else
// MTLCreateSystemDefaultDevice. nil when neither gives one, with every reason in `why`
// (each device's gate failure, or that the call found no GPU), so the user learns all of them.
id<MTLDevice> discover_device(std::string* why) {
  std::vector<std::string> reasons;
  NSArray<id<MTLDevice>>* all = MTLCopyAllDevices();
  if (all.count == 0) reasons.push_back("MTLCopyAllDevices listed no GPU");
  for (id<MTLDevice> device in all) {
    const std::string gate = device_gate(device);
    if (gate.empty()) return device;
    reasons.push_back("MTLCopyAllDevices: " + gate);
  }
  id<MTLDevice> fallback = MTLCreateSystemDefaultDevice();
  if (fallback == nil) {
    reasons.push_back("MTLCreateSystemDefaultDevice returned no GPU");
  } else {
    const std::string gate = device_gate(fallback);
    if (gate.empty()) return fallback;
    reasons.push_back("MTLCreateSystemDefaultDevice: " + gate);
  }
  for (const std::string& reason : reasons) *why += (why->empty() ? "" : "; ") + reason;
  return nil;
}

MetalState create_metal_device() {
  MetalState state;
  @autoreleasepool {
    // The kernels are Metal Shading Language 3.0.
    if (@available(macOS 13.0, *)) {
      id<MTLDevice> device = discover_device(&state.unavailable_reason);
      if (device == nil) return state;
      id<MTLCommandQueue> queue = [device newCommandQueue];
      if (queue == nil) {
        state.unavailable_reason = "could not create a Metal command queue on " +
                                   utf8(device.name);
        return state;
      }
      state.device = new MetalDevice(device, queue, MTLLanguageVersion3_0);
    } else {
      state.unavailable_reason = "Metal Shading Language 3.0 needs macOS 13 or newer";
    }
  }
  return state;
}

const MetalState& metal_state() {
  static const MetalState state = create_metal_device();
  return state;
}

}  // namespace

Device* metal_device() {
  MetalDevice* device = metal_state().device;
  return device != nullptr && !device->gate_failed() ? device : nullptr;
}

std::string metal_unavailable_reason() {
  const MetalState& state = metal_state();
  return state.device != nullptr ? state.device->gate_failure() : state.unavailable_reason;
}

double metal_gpu_seconds_total() {
  const MetalDevice* device = metal_state().device;
  return device != nullptr ? device->gpu_seconds_total() : 0.0;
}

void set_metal_fault(const std::string& kernel) { g_fault.set(kernel); }

}  // namespace jfm
