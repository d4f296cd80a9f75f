"""The intermediate representations zbcompile's passes read and write, as plain data that prints.

A leaf package: it imports torch and zbcompile.errors / zbcompile._format / zbcompile._torch_private, nothing
else of the project, so a pass, the runtime and the tools all stand on it.

    actions           Kind (F, B, W, BW, S, T, IF, IB ...), KindSpec, Action ("2B1": stage 2's B of microbatch 1)
    schedule          Schedule: per rank, the ordered actions; placement of stages on ranks; text form
    schedule_problem  the dependency graph of a schedule's actions, for generators and the simulator
    costs             Costs, MemoryModel: what each action costs in time and activation memory
    names             the stage-local value names (Role: act:, grad:, saved:, param: ...)
    stages            Traced -> Partition -> StagedModel: a step's graph, cut into stages, each with F / B / W
    program           RankProgram: one rank's straight-line ops (RUN, SEND, RECV, FREE ...) and its graph table

Glossary. A *model stage* is a contiguous piece of the model; a *stage* is one placement of it on a rank (a V
schedule places two stages per rank). A *microbatch* is one slice of the batch along dim 0. An *action* is one
stage's F, B or W of one microbatch; an *op* is one instruction of a rank program; a *value* is a tensor an op
defines and later ones read, under a global name.
"""
