"""The LoRA a training loop trains (a Tinker-protocol run, a reinforcement job): its alpha.

Tinker's alpha, whatever the rank: with PEFT's alpha / r scaling, a learning rate found at one rank
stays about right at another ("LoRA Without Regret"), and the Tinker cookbook's learning-rate advice
assumes it.
"""

LORA_ALPHA = 32
