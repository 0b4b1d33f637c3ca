"""llama.cpp's own server API: /completion, /tokenize, /slots, /props and the other native
routes."""
