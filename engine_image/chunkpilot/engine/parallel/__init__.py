"""What crosses between tensor-parallel ranks: the step plan rank 0 builds from the scheduler's output, and the group
of collectives that carries it and the model's all-reduces. Below the model, whose layers all-reduce through the
group; above the core, whose `SchedulerOutput` a plan is built from. (The shard sizes are the model's, in
model/tp_shard.py; the rank processes are the execution's, in execution/tp_worker.py.)

Empty on purpose: importing one module of the layer never loads its siblings."""
