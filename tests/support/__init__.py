"""The tests' support: stand-in trainers and rollout workers as Ray actors (parties), fault points
(faults). The built-in model layouts and the engine stand-in are the bench's (weightsync_bench)."""
