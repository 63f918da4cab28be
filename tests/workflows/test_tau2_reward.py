"""tau2's own evaluator on scripted runs, through the workflow's ``simulate`` and ``outcome_of``.

Airline task 11 (train): the customer wants to remove a passenger; the right outcome is one
``update_reservation_flights`` call (everyone to basic economy) and telling the customer the
refund (5244). A scripted agent that does exactly that earns 1.0 from tau2's DB and
communication checks; one that skips the call or the number earns 0.0; a run that never ends by
a stop earns 0.0 too. Runs in the agents venv (tau2 lives there); no LLM is called.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.agents

pytest.importorskip("tau2", reason="tau2 lives in the agents venv")

import tau2.run as tau2_run  # noqa: E402
from tau2.agent.base import LocalAgent  # noqa: E402
from tau2.data_model.message import AssistantMessage, ToolCall, UserMessage  # noqa: E402
from tau2.registry import registry  # noqa: E402
from tau2.user.base import BaseUser  # noqa: E402

from workflows.tau2.run import outcome_of, simulate  # noqa: E402

TASK_ID = "11"


Script = list[dict[str, Any]]
"""AssistantMessage fields, one reply per turn; each message is made when sent (tau2 orders by timestamp)."""


class ScriptedAgent(LocalAgent[Script]):
    def __init__(self, tools: Any, domain_policy: str, script: Script) -> None:
        super().__init__(tools=tools, domain_policy=domain_policy)
        self.script = script

    def get_init_state(self, message_history: Any = None) -> Script:
        return list(self.script)

    def generate_next_message(self, message: Any, state: Script) -> tuple[AssistantMessage, Script]:
        fields = state.pop(0) if state else {"content": "Is there anything else?"}
        return AssistantMessage(role="assistant", **fields), state


class ScriptedUser(BaseUser):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(instructions="scripted", llm=None, llm_args=None)
        self.lines = lines

    def get_init_state(self, message_history: Any = None) -> list[str]:  # type: ignore[override]
        return list(self.lines)

    def generate_next_message(self, message: Any, state: list[str]) -> tuple[UserMessage, list[str]]:  # type: ignore[override]
        return UserMessage(role="user", content=state.pop(0) if state else "Hello?"), state

    @classmethod
    def is_stop(cls, message: UserMessage) -> bool:
        return "###STOP###" in (message.content or "")


def run(script: Script, user_lines: list[str], max_steps: int = 30) -> Any:
    task = tau2_run.get_tasks("airline", task_ids=[TASK_ID])[0]
    environment = registry.get_env_constructor("airline")()
    agent = ScriptedAgent(environment.get_tools(), environment.get_policy(), script)
    return simulate("airline", task, agent, ScriptedUser(user_lines), environment, max_steps=max_steps, max_errors=5)


def gold_call() -> dict[str, Any]:
    action = tau2_run.get_tasks("airline", task_ids=[TASK_ID])[0].evaluation_criteria.actions[0]
    return {"content": None, "tool_calls": [ToolCall(id="call-1", name=action.name, arguments=action.arguments)]}


USER = [
    "I need to remove Sophia from reservation GV1N64.",
    "Yes, downgrade everyone. How much is the refund?",
    "Thanks. ###STOP###",
]


def test_the_right_actions_and_words_earn_one() -> None:
    script = [
        gold_call(),
        {"content": "Done: everyone is in basic economy; your refund is 5244 dollars to the original payment method."},
    ]
    outcome = outcome_of(run(script, USER))
    assert outcome.reward == 1.0
    assert outcome.metadata["termination_reason"] == "user_stop"
    assert outcome.metadata["reward_breakdown"] == {"DB": 1.0, "COMMUNICATE": 1.0}


def test_skipping_the_update_earns_zero() -> None:
    script = [{"content": "Your refund would be 5244 dollars."}]
    outcome = outcome_of(run(script, USER))
    assert outcome.reward == 0.0
    assert outcome.metadata["reward_breakdown"]["DB"] == 0.0


def test_not_telling_the_refund_earns_zero() -> None:
    script = [gold_call(), {"content": "All done."}]
    outcome = outcome_of(run(script, USER))
    assert outcome.reward == 0.0
    assert outcome.metadata["reward_breakdown"] == {"DB": 1.0, "COMMUNICATE": 0.0}


def test_a_run_that_never_stops_earns_zero() -> None:
    outcome = outcome_of(run([gold_call()], ["Hm."] * 50, max_steps=6))
    assert outcome.reward == 0.0
    assert outcome.metadata["termination_reason"] == "max_steps"
    assert "prematurely" in outcome.metadata["note"]
