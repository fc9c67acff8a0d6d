// The Metal device: runs the shaders/*.metal kernels on the Apple GPU. XLA:CPU calls the FFI
// handlers with host buffers; on Apple silicon the GPU shares that memory, so buffers are
// wrapped in place (page-aligned region + offset) or, when Metal refuses, staged through shared
// buffers from a pool.
//
// Memory management: ARC (this file is compiled with -fobjc-arc; there is no manual
// retain/release). Every method that touches Metal objects runs inside @autoreleasepool.
// Thread safety: the shader libraries and pipelines are built under one mutex; the staging
// pool has its own; MTLCommandQueue is itself thread-safe, so handlers may run concurrently.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "device.h"
#include "shader_sources.h"

namespace jfm {
namespace {

std::string describe(NSError* error) {
  if (error == nil) return "unknown error";
  NSString* text = error.localizedDescription;
  return text != nil ? std::string(text.UTF8String) : "unknown error";
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

class MetalDevice final : public Device {
 public:
  MetalDevice(id<MTLDevice> device, id<MTLCommandQueue> queue, MTLLanguageVersion language)
      : device_(device),
        queue_(queue),
        language_(language),
        name_(device.name.UTF8String),
        page_size_(static_cast<uintptr_t>(sysconf(_SC_PAGESIZE))),
        staging_(device) {}

  const char* kind() const override { return "metal"; }
  std::string name() const override { return name_; }

  bool has_kernel(const std::string& kernel) override {
    std::lock_guard<std::mutex> lock(mutex_);
    load_libraries();
    return library_of_.count(kernel) != 0;
  }

  std::vector<std::string> kernel_names() override {
    std::lock_guard<std::mutex> lock(mutex_);
    load_libraries();
    std::vector<std::string> names;
    for (const auto& entry : library_of_) names.push_back(entry.first);
    std::sort(names.begin(), names.end());
    return names;
  }

  std::string library_error() override {
    std::lock_guard<std::mutex> lock(mutex_);
    load_libraries();
    return library_error_;
  }

  std::string run(const std::vector<Submission>& submissions) override {
    @autoreleasepool {
      std::vector<Staged> staged;
      std::vector<id<MTLCommandBuffer>> committed;
      std::string error;
      for (const Submission& submission : submissions) {
        error = encode_and_commit(submission, &staged, &committed);
        if (!error.empty()) break;
      }
      // Wait for everything committed, even after an error: the GPU may still be using the
      // host memory, which XLA reclaims once the handler returns.
      for (id<MTLCommandBuffer> command_buffer : committed) {
        [command_buffer waitUntilCompleted];
        if (error.empty() && command_buffer.status != MTLCommandBufferStatusCompleted) {
          error = "command buffer failed: " + describe(command_buffer.error);
        }
      }
      for (const Staged& s : staged) {
        if (error.empty() && s.copy_back) std::memcpy(s.host, s.buffer.contents, s.size);
        staging_.release(s.buffer);
      }
      return error;
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

  // Where a host range is bound for one submission.
  struct Bound {
    id<MTLBuffer> buffer;
    NSUInteger offset;
    ptrdiff_t staged_index;  // into the Staged list, or -1 when wrapped in place
  };

  // Compiles every embedded source once; a source that fails to compile contributes no
  // kernels and its message is kept for library_error(). Caller holds mutex_.
  void load_libraries() {
    if (loaded_) return;
    loaded_ = true;
    @autoreleasepool {
      MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
      options.languageVersion = language_;
      // Safe math: no reassociation or finite-math assumptions; the kernels rely on IEEE
      // behaviour for -inf/NaN handling. Kernels call fast:: functions where they choose to.
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
      for (const ShaderSource& source : shader_sources()) {
        NSString* text = [[NSString alloc] initWithBytes:source.text
                                                  length:source.size
                                                encoding:NSUTF8StringEncoding];
        NSError* error = nil;
        id<MTLLibrary> library = [device_ newLibraryWithSource:text options:options error:&error];
        if (library == nil) {
          if (!library_error_.empty()) library_error_ += "\n";
          library_error_ += std::string(source.file) + ": " + describe(error);
          continue;
        }
        for (NSString* function in library.functionNames) {
          library_of_[function.UTF8String] = library;
        }
      }
    }
  }

  // The cached pipeline for `kernel`, built on first use; nil with `error` set on failure.
  id<MTLComputePipelineState> pipeline(const std::string& kernel, std::string* error) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto cached = pipelines_.find(kernel);
    if (cached != pipelines_.end()) return cached->second;
    load_libraries();
    auto library = library_of_.find(kernel);
    if (library == library_of_.end()) {
      *error = "no kernel '" + kernel + "' in the shader library" +
               (library_error_.empty() ? "" : ": " + library_error_);
      return nil;
    }
    id<MTLFunction> function =
        [library->second newFunctionWithName:[NSString stringWithUTF8String:kernel.c_str()]];
    if (function == nil) {
      *error = "could not load kernel '" + kernel + "'";
      return nil;
    }
    NSError* ns_error = nil;
    id<MTLComputePipelineState> state = [device_ newComputePipelineStateWithFunction:function
                                                                               error:&ns_error];
    if (state == nil) {
      *error = "could not build the pipeline of '" + kernel + "': " + describe(ns_error);
      return nil;
    }
    pipelines_.emplace(kernel, state);
    return state;
  }

  // Binds a host range: wrapped in place when Metal accepts the page-aligned region around it,
  // else through a staging buffer (copied in now when the first use reads it).
  std::string bind(const Binding& binding, std::vector<Staged>* staged, Bound* bound) {
    const size_t size = std::max<size_t>(binding.size, 1);
    if (size > device_.maxBufferLength) {
      return "a buffer of " + std::to_string(size) + " bytes exceeds the device's limit of " +
             std::to_string(device_.maxBufferLength);
    }
    const uintptr_t address = reinterpret_cast<uintptr_t>(binding.data);
    const uintptr_t start = address & ~(page_size_ - 1);
    const uintptr_t end = (address + size + page_size_ - 1) & ~(page_size_ - 1);
    if (end - start <= device_.maxBufferLength) {
      id<MTLBuffer> wrapped = [device_ newBufferWithBytesNoCopy:reinterpret_cast<void*>(start)
                                                         length:end - start
                                                        options:MTLResourceStorageModeShared
                                                    deallocator:nil];
      if (wrapped != nil) {
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

  // Encodes one submission into its own command buffer and commits it.
  std::string encode_and_commit(const Submission& submission, std::vector<Staged>* staged,
                                std::vector<id<MTLCommandBuffer>>* committed) {
    id<MTLCommandBuffer> command_buffer = [queue_ commandBuffer];
    if (command_buffer == nil) return "could not create a command buffer";
    id<MTLComputeCommandEncoder> encoder = [command_buffer computeCommandEncoder];
    if (encoder == nil) return "could not create a compute command encoder";
    // One Metal buffer per distinct host range, so a range written by one dispatch and read by
    // the next (the backward's delta) is the same buffer. The default (serial) encoder orders
    // the dispatches.
    std::map<std::pair<void*, size_t>, Bound> ranges;
    std::string error;
    for (const Dispatch& d : submission) {
      id<MTLComputePipelineState> state = pipeline(d.kernel, &error);
      if (state == nil) break;
      const NSUInteger threads = NSUInteger{d.group_size[0]} * d.group_size[1] * d.group_size[2];
      if (threads > state.maxTotalThreadsPerThreadgroup) {
        error = "kernel '" + d.kernel + "' allows " +
                std::to_string(state.maxTotalThreadsPerThreadgroup) +
                " threads per threadgroup, the dispatch needs " + std::to_string(threads);
        break;
      }
      [encoder setComputePipelineState:state];
      for (const Binding& b : d.buffers) {
        auto key = std::make_pair(b.data, b.size);
        auto it = ranges.find(key);
        if (it == ranges.end()) {
          Bound bound;
          error = bind(b, staged, &bound);
          if (!error.empty()) break;
          it = ranges.emplace(key, bound).first;
        } else if (b.written && it->second.staged_index >= 0) {
          (*staged)[it->second.staged_index].copy_back = true;
        }
        [encoder setBuffer:it->second.buffer offset:it->second.offset atIndex:b.index];
      }
      if (!error.empty()) break;
      [encoder setBytes:d.constants.data() length:d.constants.size() atIndex:d.constants_index];
      [encoder dispatchThreadgroups:MTLSizeMake(d.groups[0], d.groups[1], d.groups[2])
              threadsPerThreadgroup:MTLSizeMake(d.group_size[0], d.group_size[1],
                                                d.group_size[2])];
    }
    [encoder endEncoding];
    if (!error.empty()) return error;  // never commit a partly encoded submission
    [command_buffer commit];
    committed->push_back(command_buffer);
    return "";
  }

  id<MTLDevice> device_;
  id<MTLCommandQueue> queue_;
  const MTLLanguageVersion language_;
  const std::string name_;
  const uintptr_t page_size_;
  StagingPool staging_;

  std::mutex mutex_;  // guards everything below
  bool loaded_ = false;
  std::string library_error_;
  std::unordered_map<std::string, id<MTLLibrary>> library_of_;  // kernel name -> its library
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
};

struct MetalState {
  MetalDevice* device = nullptr;  // lives for the whole process
  std::string unavailable_reason;
};

MetalState create_metal_device() {
  MetalState state;
  @autoreleasepool {
    // The kernels are Metal Shading Language 3.0.
    if (@available(macOS 13.0, *)) {
      id<MTLDevice> device = MTLCreateSystemDefaultDevice();
      if (device == nil) {
        state.unavailable_reason = "MTLCreateSystemDefaultDevice found no Metal GPU";
        return state;
      }
      id<MTLCommandQueue> queue = [device newCommandQueue];
      if (queue == nil) {
        state.unavailable_reason = "could not create a Metal command queue";
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

Device* metal_device() { return metal_state().device; }

std::string metal_unavailable_reason() { return metal_state().unavailable_reason; }

}  // namespace jfm
