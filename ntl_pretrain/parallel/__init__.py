"""How the ranks split the work: the process group and the tensor-parallel size (`distributed`), the dp x sp x tp
layout and its groups (`layout`), and Ulysses sequence parallelism (`ulysses`)."""
