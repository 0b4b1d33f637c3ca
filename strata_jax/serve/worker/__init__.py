"""The engine process: the worker that drives the Engine over stdin/stdout frames, the prompts it
prepares, the process group's followers, and the mock worker the supervisor's tests drive."""
