"""What a run reports while it trains: TensorBoard and the console (`monitor`), tokens/s, TFLOP/s and MFU
(`throughput`)."""
