"""The causal LM: its build or load (`build`), which open model families run at which tensor-parallel size
(`families`), and the ZeRO-3 partitioned and AutoTP slice loading (`loading`)."""
