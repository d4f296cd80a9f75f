"""Compiler passes: trace, partition, split F/B/W, schedule generators, lowering. Ships as zbcompile.passes."""
