"""llama.cpp's file format: a GPT in its Hugging Face layout written as one GGUF file (`writer.py`)."""
