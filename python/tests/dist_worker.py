# One rank of test_distributed.py's world, started by `porter launch`: trains the layer model
# of test_layers.py at ZeRO stage 2 with the step API on its own micro-batches and writes its
# losses and parameters to <out>/rank<r>.npz.
import pathlib
import sys

import numpy as np

import porter

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_layers import SPEC, batch, distributed_config  # noqa: E402

out = pathlib.Path(sys.argv[1])
config = porter.Config(distributed_config(micro_batches=2, world_size=2))
d = porter.init_distributed(config)
engine = porter.Engine(config, SPEC, distributed=d)
losses = []
for step in range(3):
    for m in range(2):
        engine.forward(batch(step, 2 * d.rank + m))  # global micro-batch 2r + m
        engine.backward()
        result = engine.step()
    losses.append(result["loss"])
np.savez(out / f"rank{d.rank}.npz", losses=np.array(losses), params=engine.params(),
         world=np.array([d.world_size, d.dp_size, engine.rank]))
