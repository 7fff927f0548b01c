"""How the engine core's steps reach the model: in its own process, or in one worker process per rank of a
tensor- and pipeline-parallel group (torch.distributed's state lives in kvfleet.runtime.distributed)."""
