"""weightsync in one page: a trainer pushes three versions of a torch model to two rollout
workers (Ray actors) over shared memory. Run: python examples/quickstart.py"""

import ray
import torch

from weightsync import Coordinator, SyncConfig, WeightReceiver, WeightSender


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))


@ray.remote(num_cpus=0)
class Rollout:
    """Stands in for a vLLM worker: load_weights(Iterable[(name, tensor)]) copies in place.
    Written out here rather than the bench's ToyEngine: the example reads in one file
    and its engine is the torch module the trainer trains, not a dict of zeros."""

    def __init__(self, coordinator: Coordinator, rank: int):
        self.model = make_model()
        params = dict(self.model.named_parameters())

        def load_weights(weights):
            with torch.no_grad():
                for name, tensor in weights:
                    params[name].copy_(tensor)

        self.receiver = WeightReceiver(coordinator, load_weights, name=f"rollout-{rank}", rank=rank,
                                       expected=self.model.state_dict())

    def apply(self, version: int) -> int:
        return self.receiver.apply(version)  # blocks until every bucket arrived, verified and loaded

    def state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def close(self) -> None:
        self.receiver.close()


def main() -> None:
    ray.init(include_dashboard=False, logging_level="ERROR")
    coordinator = Coordinator.create(SyncConfig(transport="shm", bucket_mb=1))
    rollouts = [Rollout.remote(coordinator, rank) for rank in range(2)]
    policy = make_model()
    sender = WeightSender(coordinator, expected_receivers=2)
    optim = torch.optim.SGD(policy.parameters(), lr=0.1)
    for step in range(1, 4):
        loss = policy(torch.randn(32, 64)).pow(2).mean()  # a real optimizer step
        optim.zero_grad()
        loss.backward()
        optim.step()
        sender.stage(step, policy.state_dict())  # trainer is free once this returns
        applied = [r.apply.remote(step) for r in rollouts]
        result = sender.sync(step)  # the barrier: every receiver committed `step`
        served = ray.get(applied)
        exact = all(torch.equal(policy.state_dict()[n], t) for s in ray.get([r.state.remote() for r in rollouts])
                    for n, t in s.items())
        print(f"step {step}: receivers serve {served}, {result.bytes} bytes, barrier {result.barrier_s * 1e3:.1f} ms, "
              f"bit-exact: {exact}")
    print(coordinator.format_status())
    ray.get([r.close.remote() for r in rollouts])
    sender.close()
    coordinator.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
