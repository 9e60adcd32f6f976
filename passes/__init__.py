"""Graph passes, one per module, each a function named after its module:
`pass_name(program: Program, ctx: PassContext) -> None`, editing in place."""
