# frozen_string_literal: true

require_relative 'puppet_run'

require 'puppet/type/vmhost_vm'
require 'puppet/provider/vmhost_vm/vmhostd'
require_relative 'fake_vm_logic'

# A NIC's capture members (mode monitor, source, direction) and trunk members (vlans, trunk) in
# a real (in-process) catalog run against a fake daemon that echoes them as vmhostd does.
class TestCapture < Minitest::Test
  include PuppetRun
  include FakeVmLogic

  MONITOR = { 'mode' => 'monitor', 'source' => 'eth1', 'direction' => 'ingress' }.freeze

  def test_capture_and_trunk_members_are_sent_and_a_rerun_as_vmhostd_echoes_them_changes_nothing
    nics = [{ 'network' => 'lan', 'mode' => 'bridge', 'vlans' => %w[10 20], 'trunk' => false },
            { 'network' => 'lan', 'trunk' => true }, MONITOR]
    assert apply_vm(**web1(nics: nics)).changed
    sent = @fake.request_list[1]['params']['spec']['nics']
    assert_equal [{ 'network' => 'lan', 'mode' => 'bridge', 'vlans' => [10, 20], 'trunk' => false },
                  { 'network' => 'lan', 'trunk' => true }, MONITOR], sent
    assert_equal [{ 'network' => 'lan', 'vlans' => [10, 20] }, { 'network' => 'lan', 'trunk' => true }, MONITOR],
                 @vms['web1']['spec']['nics']
    refute apply_vm(**web1(nics: nics)).changed
    assert_equal %w[vm.list], @fake.methods_called
  end

  def test_a_changed_direction_is_an_in_place_change_of_nics
    apply_vm(**web1(nics: [MONITOR]))
    @fake.request_list
    status = apply_vm(**web1(nics: [MONITOR.merge('direction' => 'both')]))
    assert status.changed
    refute status.failed
    assert_equal 'both', @fake.request_list[1]['params']['spec']['nics'][0]['direction']
    assert_includes logs_text, 'reconfigured in place, disk kept (nics)'
  end

  def test_a_source_the_host_does_not_list_fails_with_the_daemons_3001_naming_nics
    self.refuse = { 'code' => 3001, 'message' => 'the host config lists no capture interface eth9',
                    'data' => { 'kind' => 'not_in_model', 'field' => 'spec.nics[0].source', 'details' => nil } }
    status = apply_vm(**web1(nics: [MONITOR.merge('source' => 'eth9')]))
    assert status.failed
    assert_includes logs_text, 'error 3001 (not_in_model) on field spec.nics[0].source: ' \
                               'the host config lists no capture interface eth9 (attribute nics)'
    assert_empty @vms
  end
end
