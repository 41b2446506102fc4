"""offline/: commands over checkpoints that need no training code: consolidate (to Hugging
Face safetensors), inspect statistics and health, diff, export. Every format is read
through ``formats/``; torch is imported only where values are reduced, compared or cast."""
