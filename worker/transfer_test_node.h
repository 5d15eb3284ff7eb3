// A worker for the transfer tests: a WorkerService over its own core, store
// and pool (a RecordingDevice, optionally with a shared arena), served on
// 127.0.0.1 with a stub to it. Header-only, for worker tests; include after
// worker_service_test_util.h's dependencies.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "triax/v1/worker.grpc.pb.h"
#include "worker/page_allocator.h"
#include "worker/recording_device.h"
#include "worker/sequence_store.h"
#include "worker/worker_core.h"
#include "worker/worker_service.h"

namespace triax::worker {

// Service options of a worker on `path`, with the corruption hook set to
// every `corrupt`-th exported page (0: off).
inline WorkerServiceOptions Path(TransferPath path, uint32_t corrupt = 0) {
  WorkerServiceOptions o;
  o.transfer_path = path;
  o.testing_corrupt_export_pages = corrupt;
  return o;
}

// One worker served on 127.0.0.1.
struct Node {
  // `share_arena`: the device's arena is shared memory, and the service
  // pulls imports over the ipc path when `options.transfer_path` says so.
  // `links`: the device's TCP links are on (the link path).
  explicit Node(WorkerServiceOptions options = {}, bool share_arena = false,
                bool links = false)
      : device(share_arena) {
    options.device = &device;
    if (links) {
      LinkOptions link_options;
      link_options.tcp_host = "127.0.0.1";
      EXPECT_TRUE(device.EnableLinks(link_options).ok());
    }
    auto a = PageAllocator::Create(&device, 4 << 20);
    EXPECT_TRUE(a.ok());
    alloc = *std::move(a);
    store =
        std::make_unique<SequenceStore>(&device, alloc.get(), StoreOptions{4});
    core = std::make_unique<WorkerCore>(store.get(), &device);
    service = std::make_unique<WorkerService>(core.get(), options);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    EXPECT_NE(server, nullptr);
    address = "127.0.0.1:" + std::to_string(port);
    stub = v1::Worker::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  }
  ~Node() { server->Shutdown(); }

  grpc::Status Write(const std::string& seq, const v1::KvChunk& chunk,
                     const std::string& tenant = "tenant-a") {
    grpc::ClientContext ctx;
    v1::WriteKVResponse resp;
    auto writer = stub->WriteKV(&ctx, &resp);
    v1::WriteKVRequest m;
    m.set_tenant_id(tenant);
    m.set_sequence_id(seq);
    *m.mutable_chunk() = chunk;
    writer->Write(m);
    writer->WritesDone();
    return writer->Finish();
  }

  RecordingDevice device;
  std::unique_ptr<PageAllocator> alloc;
  std::unique_ptr<SequenceStore> store;
  std::unique_ptr<WorkerCore> core;
  std::unique_ptr<WorkerService> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
  std::unique_ptr<v1::Worker::Stub> stub;
};

}  // namespace triax::worker
