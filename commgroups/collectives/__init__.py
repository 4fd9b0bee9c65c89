"""Using a group: a role's collective API (RoleCollectives) and the async-and-wait rule for
any caller (async_and_wait_scope, AsyncWaitDist).
"""
