"""Reward calls in sandbox processes (``reef reward --sandbox process``).

- ``categories``: how a sandboxed call ends without a reward (``SandboxFailure`` and its
  categories, ``RaisedInSandbox``) and the ``Limits`` of one call;
- ``pool``: ``SandboxPool``, pre-started worker processes that run the calls, kill them at
  the timeout and replace themselves;
- ``worker``: the worker process's entry point (``python -m reef_stream.consumers.reward.sandbox.worker``);
- ``cgroups``, ``seccomp``, ``libc``: a worker's cgroup (its slot), the calls' system-call
  filter, and the C library's functions the sandbox calls;
- ``code_reward``: ``CodeExecutionReward``, a built-in reward that runs model-written Python
  against test cases;
- ``latency``: ``LatencyWindow``, the percentiles of recent durations.
"""
