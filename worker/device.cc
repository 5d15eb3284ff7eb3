#include "worker/device.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "kernels/numeric.h"

namespace triax::worker {

absl::Status Device::DecodeAttentionBatch(
    absl::Span<const kernels::DecodeParams> batch) {
  for (size_t i = 0; i < batch.size(); ++i) {
    if (absl::Status s = DecodeAttention(batch[i]); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("batch[", i, "]: ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Device::DemotePages(const kernels::PageShape& shape,
                                 absl::Span<const DemoteJob> jobs) {
  std::vector<float> kf, vf;
  std::vector<uint16_t> k, v;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const DemoteJob& j = jobs[i];
    if (j.num_tokens < 1 || j.num_tokens > shape.tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("jobs[", i, "].num_tokens=", j.num_tokens,
                       " is outside 1..", shape.tokens));
    }
    const size_t n =
        static_cast<size_t>(j.num_tokens) * shape.heads * shape.head_dim;
    kf.resize(n);
    vf.resize(n);
    k.resize(n);
    v.resize(n);
    if (absl::Status s = DecodePage(j.from, shape, j.src, j.num_tokens,
                                    kf.data(), vf.data());
        !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("jobs[", i, "]: ", s.message()));
    }
    for (size_t x = 0; x < n; ++x) {
      k[x] = kernels::FloatToBf16(kf[x]);
      v[x] = kernels::FloatToBf16(vf[x]);
    }
    if (absl::Status s =
            EncodePage(j.to, shape, k.data(), v.data(), j.num_tokens, j.dst);
        !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("jobs[", i, "]: ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint8_t*> CpuDevice::AllocateArena(size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError("arena bytes must be > 0");
  }
  const size_t rounded = (bytes + 255) & ~size_t{255};
  void* p = std::aligned_alloc(256, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu backend: cannot allocate an arena of ", bytes,
                     " bytes from host memory"));
  }
  return static_cast<uint8_t*>(p);
}

void CpuDevice::FreeArena(uint8_t* base, size_t /*bytes*/) { std::free(base); }

absl::Status CpuDevice::EncodePage(const kernels::Encoding& e,
                                   const kernels::PageShape& shape,
                                   const uint16_t* k_bf16,
                                   const uint16_t* v_bf16, int num_tokens,
                                   uint8_t* page) {
  kernels::EncodePage(e, shape, k_bf16, v_bf16, num_tokens, page);
  return absl::OkStatus();
}

absl::Status CpuDevice::DecodePage(const kernels::Encoding& e,
                                   const kernels::PageShape& shape,
                                   const uint8_t* page, int num_tokens,
                                   float* k_out, float* v_out) {
  kernels::DecodePage(e, shape, page, num_tokens, k_out, v_out);
  return absl::OkStatus();
}

absl::Status CpuDevice::WriteBf16Tokens(const kernels::PageShape& shape,
                                        const uint16_t* k_bf16,
                                        const uint16_t* v_bf16, int first_slot,
                                        int num_tokens, uint8_t* page) {
  const size_t stride = static_cast<size_t>(shape.heads) * shape.head_dim;
  for (int i = 0; i < num_tokens; ++i) {
    kernels::WriteBf16Token(shape, k_bf16 + i * stride, v_bf16 + i * stride,
                            first_slot + i, page);
  }
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyPage(uint8_t* dst, const uint8_t* src,
                                 size_t bytes) {
  std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuDevice::DecodeAttention(const kernels::DecodeParams& p) {
  kernels::DecodeAttentionRef(p);
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyToHost(void* host_dst, const uint8_t* dev_src,
                                   size_t bytes) {
  std::memcpy(host_dst, dev_src, bytes);
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyFromHost(uint8_t* dev_dst, const void* host_src,
                                     size_t bytes) {
  std::memcpy(dev_dst, host_src, bytes);
  return absl::OkStatus();
}

absl::StatusOr<uint8_t*> CpuDevice::AllocateHostTier(size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError("host tier bytes must be > 0");
  }
  const size_t rounded = (bytes + 255) & ~size_t{255};
  void* p = std::aligned_alloc(256, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cpu backend: cannot allocate a host tier of ", bytes, " bytes"));
  }
  return static_cast<uint8_t*>(p);
}

void CpuDevice::FreeHostTier(uint8_t* base, size_t /*bytes*/) {
  std::free(base);
}

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(
    absl::string_view backend, const DeviceOptions& options) {
  if (backend == "cpu") {
    return std::unique_ptr<Device>(new CpuDevice());
  }
  if (backend == "cuda") {
    if (absl::Status s = CudaAvailable(); !s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("backend=\"cuda\": ", s.message(),
                       "; use --backend=cpu or --backend=auto"));
    }
    return CreateCudaDevice(options.cuda_device);
  }
  if (backend == "auto") {
    if (CudaAvailable().ok()) return CreateCudaDevice(options.cuda_device);
    return std::unique_ptr<Device>(new CpuDevice());
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "backend=", Quote(backend), " is not one of auto, cpu, cuda"));
}

}  // namespace triax::worker
