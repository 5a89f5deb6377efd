// porter::init_distributed (Note [Joining the world] in engine/distributed.h): the launcher's
// environment becomes process groups an Engine trains on, bit for bit as the thread ranks'
// communicators; one rank connects nothing; a world tensor_parallel does not divide is
// refused before anything connects.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "comm/env.h"
#include "engine/distributed.h"
#include "engine/engine.h"
#include "engine_test_util.h"

namespace porter::engine {
namespace {

using namespace testing;
using ::testing::HasSubstr;

uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

TEST(InitDistributed, TorchrunsEnvironmentGivesGroupsThatTrainAsThreadRanks) {
  const config::Config c = zero_config(2, 2);
  const uint16_t port = free_port();
  std::vector<std::vector<float>> params(2);
  std::vector<std::thread> ranks;
  std::vector<std::exception_ptr> errors(2);
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        const comm::DistEnv env = comm::dist_env_from(comm::env_lookup(
            {{"RANK", std::to_string(r)}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", std::to_string(r)},
             {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
             {"MASTER_PORT", std::to_string(port)}}));
        EXPECT_EQ(env.source, "torchrun");
        auto device = cpu_device();
        DistributedOptions o;
        o.timeout_s = c.porter.comm.timeout_s;
        const Distributed world = init_distributed(*device, env, o);
        EXPECT_EQ(world.rank(), r);
        EXPECT_EQ(world.groups.dp_size, 2);
        EXPECT_EQ(world.groups.dp_rank, r);
        Engine e(*device, std::make_unique<TransformerModel>(c.porter.model), c, world.groups);
        const io::DataSource data(c.porter.data, c.porter.model.vocab,
                                  c.train_micro_batch_size_per_gpu, c.porter.model.seq_len);
        for (int s = 0; s < 2; ++s) (void)e.train_step(data.rank_batches(s, 1, r, 2));
        params[static_cast<size_t>(r)] = e.params_host();
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  const std::vector<DpRankRun> threads = run_dp_ranks(c, 2);
  EXPECT_TRUE(bitwise_equal(params[0], threads[0].params));
  EXPECT_TRUE(bitwise_equal(params[1], threads[1].params));
}

TEST(InitDistributed, OneRankConnectsNothing) {
  auto device = cpu_device();
  const Distributed world = init_distributed(*device, comm::DistEnv{}, DistributedOptions{});
  EXPECT_FALSE(world.distributed());
  EXPECT_EQ(world.store, nullptr);
  EXPECT_EQ(world.world, nullptr);
  EXPECT_EQ(world.groups.dp_size, 1);
}

TEST(InitDistributed, AWorldTensorParallelDoesNotDivideIsRefused) {
  auto device = cpu_device();
  comm::DistEnv env;
  env.world_size = 3;
  env.source = "torchrun";
  DistributedOptions o;
  o.tensor_parallel = 2;
  EXPECT_THAT(error_of<InvalidArgument>([&] { (void)init_distributed(*device, env, o); }),
              HasSubstr("3 ranks (torchrun) do not split into tensor-parallel groups of 2"));
}

}  // namespace
}  // namespace porter::engine
