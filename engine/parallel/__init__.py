"""Several devices behind one engine: tensor parallel (`LLM(tensor_parallel_size=N)`) and expert parallel.

`comm` holds the process group (gloo on CPU, NCCL on CUDA) built from a private TCP store, never the
global `torch.distributed` default group, so that several engines may live in one process. `sharding`
says which slice of each checkpoint tensor a rank keeps, `tp_model` runs a rank's shard, `driver` and
`worker` split one engine over processes (rank 0 is the user's process and runs the scheduler and the
sampler; ranks 1..N-1 only run the model), `expert_parallel` shards a MoE layer's experts.
"""
