"""Image data for the vision recipes: sources (the embedded digits, ImageFolder roots), TOML augmentation through
torchvision.transforms.v2 seeded per sample, class-balanced sampling, and the resumable dataset the loop's
sampler draws from (:mod:`.dataset`)."""
