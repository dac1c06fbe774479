"""Idle-time drafter training ("spot" training on workers whose rollout share is done).

harvest      -- `HarvestBuffer`: byte-bounded, recency-weighted drafter training data
coordinator  -- `WorkerCoordinator`: BUSY / IDLE / TRAINING over a torch.distributed Store
trainer      -- `SpotTrainer` (preemptible AdamW loop) and `train_while_idle` (one rank, one RL step)
averaging    -- samples-weighted elastic averaging of drafter replicas at the meet (through node leaders on several nodes)
losses       -- trainer loss adapters over the drafter's own losses
checkpoint   -- `CheckpointManager`: asynchronous, atomic, validated checkpoints
time_keeper  -- the job's time limit (SLURM), read rarely: whether a step and its checkpoint still fit
config       -- `IdleDrafterConfig` and the trainer's config
"""
