"""The cost of cross-process collectives on this machine, apart from the engine (issue 19, item 2):
8 layers of (a [4, 1024] x [1024, 1024] float32 product, then a psum over the mesh), as one program
over 2 devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python scripts/probe_gloo.py 0 1     # one
        process, 2 devices
    python scripts/probe_gloo.py 0 2 PORT & python scripts/probe_gloo.py 1 2 PORT           # 2
        processes (gloo)

--mode=dot (the default) as above; --mode=psum: the psums alone (no product, the same [4, 1024]
float32 sums); --mode=dot-only: the products alone (no psum). Prints the mean time a call of 100
calls, after 5 unmeasured.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

mode = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--mode=")), "dot")
sys.argv = [a for a in sys.argv if not a.startswith("--mode=")]
pid, n = int(sys.argv[1]), int(sys.argv[2])
if n > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{sys.argv[3]}", n, pid, initialization_timeout=60)
mesh = Mesh(np.array(jax.devices()), ("x",))
w = jax.device_put(np.random.RandomState(0).randn(8, 1024, 1024).astype(np.float32) / 32,
                   NamedSharding(mesh, P()))


def layers(w, x):
    for i in range(8):
        y = jnp.tanh(x + w[i, 0, 0] if mode == "psum" else x @ w[i])
        x = (y if mode == "dot-only" else jax.lax.psum(y, "x")) / 2
    return x


program = jax.jit(jax.shard_map(layers, mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                                check_vma=False))
x = np.ones((4, 1024), np.float32)
for _ in range(5):
    np.asarray(program(w, x))
t = time.perf_counter()
for _ in range(100):
    np.asarray(program(w, x))
print(f"process {pid} of {n}, {len(jax.devices())} devices, {mode}: "
      f"{(time.perf_counter() - t) * 10:.1f} ms a call", flush=True)
