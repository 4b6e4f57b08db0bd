"""The fp32_islands patch: a module whose forward pass overflows float16 runs in float32 from then on.

- ``patch``: what the patch switches on: the healing, and the listener through which SafeGradScaler's steps reach it.
- ``healing``: ``Healing``, one per apply, held by the patch's listener: what happens at a skipped step: the probe
  armed, its verdict read with the scaler's own read, an island made, buffers put back.
- ``iteration_ends``: the end of each update as the healing acts on it: host mode, device mode for fused
  optimizers, DeepSpeed's loss-scale steps.
- ``probe``: the global module hooks that find the first module turning finite inputs into inf/NaN.
- ``watch_verdicts``: what the headroom watch's (:mod:`ampguard.headroom_watch`) sightings decide: an island before an overflow, or the module blamed at one.
- ``islands``: ``Islands``, one per apply, held by the healing: making, naming, taking back and reporting islands.
- ``checkpoint_islands``: the islands a loaded checkpoint names, re-applied at the next module call.
- ``compiled_islands``: an island that compiled code leaves out, named once.
- ``island_hooks``: the hooks an island carries and the table they read (a saved or copied model keeps working, its
  hooks doing nothing; compiled code leaves them out, fullgraph included).
- ``island_io``: the inputs cast to float32 at any depth, the outputs given back their autocast dtypes.
- ``half_parameters``: an island's float16/bfloat16 parameters and buffers read as float32 copies, call by call.
- ``tensor_tree``: the floating tensors inside any nesting of containers (torch's pytree, dataclasses).
- ``model_tree``: the top-level module above a module (the object the script holds), for names that work.
- ``buffers``: BatchNorm statistics and other buffers put back after an overflowing forward pass.

docs/islands.md describes the behaviour.
"""
