"""The tools built on tierstore: the ``tierstore`` command (demo, plan, benches, gc), the example ViT and the
torchrun example. They use the core (``tierstore``) and the integrations (``tierstore.integrations``); neither
imports them."""
