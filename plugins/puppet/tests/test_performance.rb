# frozen_string_literal: true

require_relative 'puppet_run'

require 'puppet/type/vmhost_vm'
require 'puppet/provider/vmhost_vm/vmhostd'
require_relative 'fake_vm_logic'

# The placement members (cpu_policy, numa, hugepages, emulator_cpu) and a NIC's queues in a
# real (in-process) catalog run against a fake daemon that echoes them as vmhostd does.
class TestPerformance < Minitest::Test
  include PuppetRun
  include FakeVmLogic

  def test_performance_members_are_sent_and_a_rerun_as_vmhostd_echoes_them_changes_nothing
    # vmhostd leaves out cpu_policy shared, emulator_cpu false and a NIC's queues of 1.
    nics = [{ 'network' => 'lan', 'queues' => '1' }, { 'network' => 'cap', 'queues' => '4' }]
    attrs = web1(cpu_policy: 'shared', numa: 'none', emulator_cpu: false, nics: nics)
    assert apply_vm(**attrs).changed
    spec = @fake.request_list[1]['params']['spec']
    assert_equal ['shared', 'none', false], spec.values_at('cpu_policy', 'numa', 'emulator_cpu')
    assert_equal [{ 'network' => 'lan', 'queues' => 1 }, { 'network' => 'cap', 'queues' => 4 }], spec['nics']
    refute spec.key?('hugepages')
    refute_includes @vms['web1']['spec'].keys, 'cpu_policy'
    refute apply_vm(**attrs).changed
    assert_equal %w[vm.list], @fake.methods_called
  end

  def test_dedicated_numa_node_and_hugepages_are_sent_as_vmhostd_takes_them
    apply_vm(**web1)
    @fake.request_list
    status = apply_vm(name: 'web1', cpu_policy: 'dedicated', numa: '1', hugepages: '2M', emulator_cpu: 'true')
    assert status.changed
    refute status.failed
    spec = @fake.request_list[1]['params']['spec']
    # A node is a JSON number, emulator_cpu a JSON boolean.
    assert_equal ['dedicated', 1, '2M', true], spec.values_at('cpu_policy', 'numa', 'hugepages', 'emulator_cpu')
    assert_includes logs_text, 'reconfigured in place, disk kept (cpu_policy, emulator_cpu, hugepages, numa)'
    refute apply_vm(name: 'web1', cpu_policy: 'dedicated', numa: 1, hugepages: '2M', emulator_cpu: true).changed
  end

  def test_absent_removes_numa_and_hugepages_and_defaults_are_sent_explicitly
    apply_vm(**web1(cpu_policy: 'dedicated', numa: '1', hugepages: '2M', emulator_cpu: true))
    @fake.request_list
    assert apply_vm(name: 'web1', cpu_policy: 'shared', numa: 'absent', hugepages: 'absent',
                    emulator_cpu: false).changed
    spec = @fake.request_list[1]['params']['spec']
    refute spec.key?('numa')
    refute spec.key?('hugepages')
    assert_equal ['shared', false], spec.values_at('cpu_policy', 'emulator_cpu')
    refute apply_vm(name: 'web1', cpu_policy: 'shared', numa: 'absent', hugepages: 'absent',
                    emulator_cpu: false).changed
  end

  def test_a_refusal_of_a_performance_member_names_its_attribute
    self.refuse = { 'code' => 3001, 'message' => 'the host config names no vm_cpus',
                    'data' => { 'kind' => 'not_in_model', 'field' => 'spec.cpu_policy', 'details' => nil } }
    status = apply_vm(**web1(cpu_policy: 'dedicated'))
    assert status.failed
    assert_includes logs_text, 'error 3001 (not_in_model) on field spec.cpu_policy: ' \
                               'the host config names no vm_cpus (attribute cpu_policy)'
    assert_empty @vms
  end
end
