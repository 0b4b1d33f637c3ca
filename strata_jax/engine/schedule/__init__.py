"""Which work goes into a window: slots and their stops, admission, the scheduler, the prefix cache,
the conversation cache and the recurrent-state checkpoints, and the window's output turned into
events."""
