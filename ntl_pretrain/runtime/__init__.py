"""The processes around a run: the launcher choice and ports (`launcher`), the parent under `bash
launch/pretrain.sh` (`supervisor`), the run lock, start-up watchdog and shared-memory clean-up (`lifecycle`), and
the libraries' known-harmless output (`log_filter`)."""
