"""solutions/lab07_offload.py (the offloaded step): plausible student bugs, each caught by one check with the cause
named."""
from tests.mutants import Mutant

MUTANTS = [
    Mutant("counts the host's fp32 bytes, not the device dtype's, for the gradients",
           "self.traffic.to_host += g.numel() * g.element_size()",
           "self.traffic.to_host += host.numel() * host.element_size()",
           "check_bytes", "to_host counted"),
    Mutant("counts the fp32 master's bytes for the parameters going up",
           "self.traffic.to_device += p.numel() * p.element_size()",
           "self.traffic.to_device += m.numel() * m.element_size()",
           "check_bytes", "to_device counted"),
    Mutant("never copies the gradient: rebinds a local name instead",
           "host.copy_(g.reshape(-1))",
           "host = g.reshape(-1).float()",
           "check_matches_ddp", "does not hold the device gradient"),
    Mutant("keeps the device gradient as the host buffer (no copy)",
           "        for host, g in zip(self.grads, device_grads):\n            host.copy_(g.reshape(-1))",
           "        for i, (host, g) in enumerate(zip(self.grads, device_grads)):\n            self.grads[i] = "
           "g.reshape(-1).float()",
           "check_memory_by_location", "same storage"),
    Mutant("forgets to run the CPU optimizer",
           "        self.optim.step()\n",
           "        pass\n",
           "check_matches_ddp", "stepped 0 times"),
    Mutant("steps the optimizer twice",
           "        self.optim.step()\n",
           "        self.optim.step()\n        self.optim.step()\n",
           "check_matches_ddp", "stepped 2 times"),
    Mutant("never copies the updated masters back to the device",
           "            p.copy_(m.view(p.shape))\n",
           "            pass\n",
           "check_matches_ddp", "not the updated masters"),
    Mutant("gives the masters no gradient (the optimizer skips them)",
           "            m.grad = g\n",
           "            pass\n",
           "check_matches_ddp", "masters did not move"),
]
CPU_STEP = "        for m, g in zip(self.masters, grads):\n            m.grad = g\n"
DPU_SWAP = "        self.grads, self._spare = self._spare, grads\n"
DPU_START = "        self._thread.start()\n"
MUTANTS += [
    # several device tensors (ZeRO-3's shape), fp16 and bf16: each method on its own
    Mutant("sends the gradient down through fp16 (lossy)", "host.copy_(g.reshape(-1))",
           "host.copy_(g.reshape(-1).half())", "check_every_tensor", "went through fp16"),
    Mutant("gives only the first master its gradient", CPU_STEP, "        self.masters[0].grad = grads[0]\n",
           "check_every_tensor", "give EVERY master its gradient"),
    Mutant("zip's arguments swapped: the buffers get the masters as .grad", CPU_STEP,
           CPU_STEP.replace("zip(self.masters, grads)", "zip(grads, self.masters)"),
           "check_every_tensor", "gave the gradient buffers a .grad"),
    Mutant("steps with self.grads, not the gradients it was given (wrong buffer under DPU)", CPU_STEP,
           CPU_STEP.replace("zip(self.masters, grads)", "zip(self.masters, self.grads)"),
           "check_every_tensor", "stepped with self.grads"),
    Mutant("counts the bytes with = instead of += (only the last tensor's remain)",
           "self.traffic.to_host += g.numel() * g.element_size()",
           "self.traffic.to_host = g.numel() * g.element_size()", "check_bytes", "instead of added with `+=`"),
    Mutant("allocates new host gradient buffers every step",
           "        for host, g in zip(self.grads, device_grads):\n            host.copy_(g.reshape(-1))\n",
           "        self.grads = [g.reshape(-1).float().clone() for g in device_grads]\n"
           "        for host, g in zip(self.grads, device_grads):\n",
           "check_every_tensor", "replaced the host gradient buffers"),
    Mutant("rebinds p.data instead of copying into the device tensor",
           "            p.copy_(m.view(p.shape))\n", "            p.data = m.view(p.shape).to(p.dtype)\n",
           "check_every_tensor", "rebound the device tensors"),
    # the stretch task, DPU's thread (extra points): its own mutants, graded by check_dpu alone
    Mutant("DPU: steps the buffer the next backward fills (no swap)", DPU_SWAP, "",
           "check_dpu", "buffer the next backward was filling"),
    Mutant("DPU: runs the delayed step on the main thread", DPU_START,
           "        self._thread = None\n        self._run(grads)\n        self.params_to_device()\n",
           "check_dpu", "ran on the main thread"),
    Mutant("DPU: waits for the thread right away (the update is not delayed)", DPU_START,
           DPU_START + "        self.finish()\n", "check_dpu", "did not return until its delayed CPU step"),
    Mutant("DPU: joins the thread at once but copies up at the next step (blocks, no overlap)", DPU_START,
           DPU_START + "        self._thread.join()\n", "check_dpu", "it blocked on the thread"),
    Mutant("DPU: the thread copies the parameters up itself", DPU_START,
           "        self._thread = threading.Thread(target=lambda g: (self._run(g), self.params_to_device()), "
           "args=(grads,),\n                                        daemon=True)\n" + DPU_START, "check_dpu",
           "params_to_device ran on the CPU step's thread"),
    Mutant("DPU: a new spare gradient buffer every step", "        if self._spare is None:\n            self._spare",
           "        if True:\n            self._spare", "check_dpu", "different sets of host gradient buffers"),
]
MUTANTS += [
    # a copy that runs the wrong way: the cause is the method that copies, not cpu_step
    Mutant("grads_to_host: zip's arguments swapped (the device gradients get the host buffers)",
           "        for host, g in zip(self.grads, device_grads):\n            host.copy_(g.reshape(-1))",
           "        for host, g in zip(device_grads, self.grads):\n            host.copy_(g.reshape(-1))",
           "check_every_tensor", "grads_to_host wrote INTO the device gradients"),
    Mutant("params_to_device: zip's arguments swapped (the masters get the device values)",
           "        for p, m in zip(self.device_params, self.masters):\n            p.copy_(m.view(p.shape))\n"
           "            self.traffic.to_device",
           "        for p, m in zip(self.masters, self.device_params):\n            p.copy_(m.view(p.shape))\n"
           "            self.traffic.to_device",
           "check_every_tensor", "params_to_device wrote INTO the host masters"),
]
# the same three swapped zips on the training check: it names the method that copies the wrong way,
# not what that led to further on (masters that did not move)
MUTANTS += [
    Mutant(m.name + ", on the training run", m.old, m.new, "check_matches_ddp", m.expect)
    for m in MUTANTS if "zip's arguments swapped" in m.name
]
