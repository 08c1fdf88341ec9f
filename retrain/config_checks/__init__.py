"""What is wrong with a config, found before anything loads: Hydra's compose mistakes as one line, and the
values no part can work with, each named by its key."""
