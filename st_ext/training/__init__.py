"""Training: the trainers (:mod:`.trainer`), their DDP work-arounds (:mod:`.ddp`) and the trainer's
``frozen_encoders=`` option (:mod:`.frozen_encoders`)."""
