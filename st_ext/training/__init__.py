"""Training: the trainers (:mod:`.trainer`), their DDP work-arounds (:mod:`.ddp`), the trainer's
``frozen_encoders=`` option (:mod:`.frozen_encoders`), its DeepSpeed checks (:mod:`.deepspeed`), ZeRO-3
frozen encoders (:mod:`.zero3_encoders`) and saving under FSDP2 (:mod:`.fsdp_saving`). The distributed
engines' gradient reductions, which the cached losses need too, are one layer below: :mod:`st_ext.gradient_sync`."""
