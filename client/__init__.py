"""The Flower ClientApp: local training of a ViT or GPT-2 on one partition, at one width tier."""
