"""What the tests and the benchmarks share (as transformers.testing_utils does): harness only, no test logic.

    ranks        free ports, `run_ranks` (N spawned torch.distributed ranks), DeepSpeed's leftover shm buffers
    memory       peak memory of a piece of work (resident memory on CPU, the allocator's count on CUDA)
    step_memory  the peak memory of one CLIPModel training step in a fresh process (`python -m` it)
    wire         `WireBytes`: the bytes a rank sends through torch.distributed's collectives
    images       image bytes, training shards and eval shards, random model batches, made on the spot
    imageserver  `ImageServer`: a loopback HTTP server with good, failing, hanging and trickling routes
    download     the URL list and the arguments of `disco-clip data download`
    launch       the one way to launch `disco_clip_ds.train` on CPU ranks: commands (one node, or one launcher per
                 node on this host), environment, shared arguments; started in a session of its own, run to the end
    processes    a launched run's process group, waited for and killed; the training ranks under a launcher
    runs         what runs leave behind (losses, weights, complete checkpoints) and the data they start from

Import from the module that does the job (`from disco_clip_ds.testing.ranks import run_ranks`); each imports
torch and friends only inside its functions.
"""
